// Expands the metal/kernels.def rows whose kernel template the including .metal file defines. The file
// states which templates it defines, after their definitions and before including this header:
//   #define LILY_DEFINES_qgemv LILY_DEFINED
//   #include "instantiate.h"
// Rows of other templates expand to nothing (the preprocessor's probe idiom: LILY_DEFINES_<function> is
// either the two tokens `~, 1` or an unknown name), so each family's file instantiates only its rows and
// a host name is written once, in kernels.def. Tensor rows (requires = tensor) vanish below MSL 4.0.
// Included once per .metal file, at its end; no include guard on purpose.
#define LILY_DEFINED ~, 1
#define LILY_SECOND_(a, b, ...) b
#define LILY_SECOND(...) LILY_SECOND_(__VA_ARGS__)
#define LILY_CAT_(a, b) a##b
#define LILY_CAT(a, b) LILY_CAT_(a, b)
#define LILY_WHEN_0(...)
#define LILY_WHEN_1(...) __VA_ARGS__
// 1 when LILY_DEFINES_<fn> is LILY_DEFINED, else 0.
#define LILY_FILE_DEFINES(fn) LILY_SECOND(LILY_DEFINES_##fn, 0, ~)

#define LILY_INSTANTIATE_simd(name, fn, ...) \
  template [[host_name(#name)]] [[kernel]] decltype(fn<__VA_ARGS__>) fn<__VA_ARGS__>;
#if __METAL_VERSION__ >= 400
#define LILY_INSTANTIATE_tensor(name, fn, ...) LILY_INSTANTIATE_simd(name, fn, __VA_ARGS__)
#else
#define LILY_INSTANTIATE_tensor(name, fn, ...)
#endif

#define LILY_KERNEL(family, name, req, fn, ...) \
  LILY_CAT(LILY_WHEN_, LILY_FILE_DEFINES(fn))(LILY_INSTANTIATE_##req(name, fn, __VA_ARGS__))
#define LILY_KERNEL_FN(family, name, req)
#include "kernels.def"
#undef LILY_KERNEL
#undef LILY_KERNEL_FN
