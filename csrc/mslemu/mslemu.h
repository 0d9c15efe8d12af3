/* mslemu C ABI: exported by every kernel library that lower.py / lily_add_metal_emu_library() builds.
 *
 * The library is built with clang (kernels need its extensions); its users need only this plain C header and
 * dlopen/dlsym, so the gcc-built host extension never sees clang.
 *
 *   void* lib = dlopen("_metal_emu.so", RTLD_NOW | RTLD_LOCAL);
 *   if (((int (*)(void))dlsym(lib, "mslemu_abi_version"))() != MSLEMU_ABI_VERSION) ... rebuild
 *   const mslemu_kernel* k = mslemu_find_kernel("rmsnorm_bf16");
 *   mslemu_dispatch_desc d = {0};  ... fill ...
 *   char err[1024];
 *   if (mslemu_dispatch(k, &d, err, sizeof err) != 0) report(err);
 *
 * Semantics are those of a Metal compute encoder with one dispatchThreadgroups (or dispatchThreads) call
 * followed by a wait: mslemu_dispatch returns when the grid has finished. Buffers are shared-storage memory
 * read and written in place. Dispatches are serialised process-wide (one GPU queue); each may use several
 * worker threads.
 *
 * Out-of-bounds detection: a read or write past a buffer's end is reported (kernel, buffer slot, thread)
 * when the buffer ends at an inaccessible page. mslemu_alloc() returns such buffers; any other allocation
 * only faults where the OS would.
 *
 * Byte counting (count_bytes = 1, Linux x86-64): every bound buffer's pages are made inaccessible for the
 * dispatch, and the first fault on each page records it as read (a later write fault adds written) or as
 * written (first access a write). Reported per slot: the bytes of touched pages that lie inside
 * [ptr, ptr + size). The counts are exact at page granularity when each buffer owns its pages: start and
 * size page-aligned (mslemu_alloc with a multiple of 4096 bytes, or mmap). Buffers sharing a page with
 * each other or with unrelated data also count touches of the neighbour. A page first written and later
 * read counts as written only: reads of data a kernel produced itself are not traffic to memory it was given.
 */
#ifndef MSLEMU_H
#define MSLEMU_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MSLEMU_ABI_VERSION 1

typedef struct {
  void* ptr;     /* NULL for an unbound slot */
  uint64_t size; /* bytes; a `constant Args&` slot holds the struct's host bytes */
} mslemu_buffer;

typedef struct {
  uint32_t index; /* [[function_constant(index)]] */
  uint32_t reserved;
  uint64_t value; /* the constant's bytes, little-endian, as the kernel declares it: bool 0/1, int/uint,
                     float/half/bfloat as their bit patterns */
} mslemu_function_constant;

typedef enum { MSLEMU_ORDER_FORWARD = 0, MSLEMU_ORDER_REVERSE = 1, MSLEMU_ORDER_RANDOM = 2 } mslemu_order;

typedef struct mslemu_kernel mslemu_kernel;

typedef struct {
  uint32_t threadgroups[3]; /* threadgroups_per_grid (dispatchThreadgroups) */
  uint32_t threads[3];      /* threads_per_threadgroup */
  uint32_t grid[3];         /* all zero: dispatchThreadgroups. Otherwise dispatchThreads: the exact grid in
                               threads; threadgroups is then ignored and edge threadgroups are smaller */
  const mslemu_buffer* buffers; /* slot-indexed: buffers[i] is [[buffer(i)]] */
  int nbuffers;                 /* at most 31 */
  const uint32_t* threadgroup_lengths; /* [[threadgroup(i)]] byte lengths, multiples of 16 */
  int nthreadgroup;
  const mslemu_function_constant* constants;
  int nconstants;
  int order;     /* mslemu_order: thread order within each threadgroup, and threadgroup order */
  uint64_t seed; /* for MSLEMU_ORDER_RANDOM */
  int workers;   /* OS threads running threadgroups; <= 0: $MSLEMU_WORKERS, else 2 */
  int count_bytes;
  uint64_t* bytes_read;    /* out, nbuffers entries, filled when count_bytes */
  uint64_t* bytes_written; /* out, nbuffers entries, filled when count_bytes */
} mslemu_dispatch_desc;

int mslemu_abi_version(void);

/* NULL if the library has no kernel of that [[host_name]] (or function name for plain kernels). */
const mslemu_kernel* mslemu_find_kernel(const char* host_name);
int mslemu_kernel_count(void);
const char* mslemu_kernel_name(int i); /* sorted by name */

/* NULL, or why the library is unusable (two kernels with one host name). Check once after loading. */
const char* mslemu_library_error(void);

/* 0 on success. Otherwise nonzero and `error` holds a message naming the kernel and, for faults in kernel
 * code, the threadgroup, thread, simdgroup and lane; buffer contents are then unspecified. */
int mslemu_dispatch(const mslemu_kernel* kernel, const mslemu_dispatch_desc* desc, char* error, uint64_t error_len);

/* Zero-filled memory of `size` bytes, 16-byte aligned, whose end (size rounded up to 16) is followed by an
 * inaccessible page. Page-aligned too when size is a multiple of 4096. NULL on failure. */
void* mslemu_alloc(uint64_t size);
void mslemu_free(void* ptr, uint64_t size);

#ifdef __cplusplus
}
#endif
#endif /* MSLEMU_H */
