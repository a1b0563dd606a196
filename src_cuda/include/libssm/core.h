/* libssm core: status codes, error reporting, versions and the DLPack tensor type.
 *
 * Every libssm entry point returns an ssm_status. On failure, ssm_last_error() returns a
 * message for the calling thread that names the offending argument; nothing is written to
 * any output. No entry point aborts, prints, throws, synchronises a device, allocates device
 * memory or reads device memory on the host.
 *
 * This header compiles as C99 and as C++. The regions between the cdef markers hold plain
 * declarations only: the Python layer reads them to build its cffi declarations. */
#ifndef LIBSSM_CORE_H_
#define LIBSSM_CORE_H_

#include <stddef.h>
#include <stdint.h>

#if defined(LIBSSM_BUILDING)
#define SSM_API __attribute__((visibility("default")))
#else
#define SSM_API
#endif

/* The ABI major version: it is the SONAME suffix (libssm.so.0) and changes only when a
 * compiled caller would break. */
#define SSM_ABI_VERSION 0

#ifdef __cplusplus
extern "C" {
#endif

/* DLPack (https://dmlc.github.io/dlpack/latest/c_api.html), version 1.x, the subset that
 * crosses libssm's boundary. A caller that includes <dlpack/dlpack.h> before this header uses
 * that header's identical definitions instead. */
#ifndef DLPACK_DLPACK_H_
/* @cdef-begin */
typedef enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,
  kDLCUDAManaged = 13
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

typedef enum {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6
} DLDataTypeCode;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;
/* @cdef-end */
#endif

/* @cdef-begin */
/* Status codes returned by every entry point (as int, so the ABI does not depend on the
 * size a compiler gives an enum). */
enum ssm_status_code {
  SSM_SUCCESS = 0,
  SSM_ERROR_INVALID_ARGUMENT = 1, /* a null pointer where a tensor is required, a bad option */
  SSM_ERROR_SHAPE = 2,            /* a tensor's ndim or sizes do not match the op */
  SSM_ERROR_DTYPE = 3,            /* a tensor's element type is not accepted for its argument */
  SSM_ERROR_DEVICE = 4,           /* tensors on different devices, or an unsupported device */
  SSM_ERROR_LAYOUT = 5,           /* strides the op cannot honour (an output that overlaps itself) */
  SSM_ERROR_UNSUPPORTED = 6,      /* a size beyond the op's limits (dstate > 256) */
  SSM_ERROR_WORKSPACE = 7,        /* workspace missing, too small or misaligned */
  SSM_ERROR_CUDA = 8,             /* the CUDA runtime failed, or there is no usable GPU */
  SSM_ERROR_INTERNAL = 9          /* a bug in libssm */
};
typedef int ssm_status;

/* The message of the last failed call on this thread ("" if none). The pointer stays valid
 * until the next libssm call on the same thread. */
SSM_API const char* ssm_last_error(void);

/* A constant name for a status code ("SSM_ERROR_SHAPE"), or "unknown status". */
SSM_API const char* ssm_status_string(ssm_status status);

/* The library's release version, "MAJOR.MINOR.PATCH". */
SSM_API const char* ssm_version(void);

/* The ABI major version the library was built with; equals SSM_ABI_VERSION of its header. */
SSM_API int ssm_abi_version(void);

/* [out] count: the number of CUDA devices this process can use; 0 when the library was built
 * without CUDA or there is no driver or GPU (then the call still succeeds). */
SSM_API ssm_status ssm_cuda_device_count(int* count);

/* [out] name: the CUDA device's name, NUL-terminated and cut to capacity bytes. */
SSM_API ssm_status ssm_cuda_device_name(int device, char* name, size_t capacity);
/* @cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* LIBSSM_CORE_H_ */
