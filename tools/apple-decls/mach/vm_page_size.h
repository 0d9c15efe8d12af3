// The project's declaration of <mach/vm_page_size.h> (what device_metal.mm uses; see Foundation/Foundation.h).
#pragma once
#include <stdint.h>
typedef uintptr_t vm_size_t;
extern vm_size_t vm_page_size;
