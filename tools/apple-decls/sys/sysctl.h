// The project's declaration of macOS's <sys/sysctl.h> (what device_metal.mm uses; see Foundation/Foundation.h).
#pragma once
#include <stddef.h>
extern "C" int sysctlbyname(const char *, void *, size_t *, void *, size_t);
