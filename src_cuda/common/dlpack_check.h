// Validation of the DLTensor arguments of one entry-point call, shared by every op: presence,
// device, dtype, ndim and shape, data pointers, and the memory layout of outputs. A failing check
// records a message that names the argument by its C parameter name and returns its status.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "error.h"
#include "libssm/core.h"
#include "tensor_ref.h"

#define SSM_RETURN_IF_ERROR(expr)                          \
  do {                                                     \
    const ssm_status ssm_status_ = (expr);                 \
    if (ssm_status_ != SSM_SUCCESS) return ssm_status_;    \
  } while (0)

namespace ssm {

constexpr int kMaxTensorDims = 4;

// float32, float16 or bfloat16; float32 only; or int32 / int64 (index arguments, which no float
// rule accepts).
enum class DtypeRule { AnyFloat, Float32, Index };
enum class Role { Input, Output };

// One argument after TensorChecker::add: an absent optional argument has t == nullptr.
struct TensorArg {
  const char* name = "";
  const DLTensor* t = nullptr;
  Dtype dtype = Dtype::F32;
  void* data = nullptr;                    // byte_offset applied; nullptr when t->data is
  int64_t stride[kMaxTensorDims] = {};     // elements; NULL strides made explicit (row-major)

  bool present() const { return t != nullptr; }
  int ndim() const { return t->ndim; }
  int64_t size(int axis) const { return t->shape[axis]; }

  // The TensorRef an op receives: its stride[i] is this tensor's stride along axes[i], or 0 where
  // axes[i] is -1 (an axis the caller's form lacks, such as B's groups in the 3-d form).
  TensorRef ref(std::initializer_list<int> axes) const;
};

// Collects the tensor arguments of one call. Checks run in three steps: add() each argument
// (pointer, device, dtype, basic shape sanity), expect_shape() on it, and check_memory() once all
// are in (data pointers, alignment, outputs that overlap themselves, each other or an input).
class TensorChecker {
 public:
  ssm_status add(const DLTensor* t, const char* name, bool required, DtypeRule rule, Role role,
                 TensorArg* arg);

  // ndim and extents; an expected extent of -1 accepts any size and is printed by its name.
  ssm_status expect_shape(const TensorArg& arg, std::initializer_list<const char*> dims,
                          std::initializer_list<int64_t> extents) const;

  ssm_status check_memory() const;

  // The device every tensor is on (valid once one tensor has been added).
  bool on_cuda() const { return device_.device_type == kDLCUDA; }
  int device_id() const { return device_.device_id; }

 private:
  static constexpr int kMaxArgs = 32;
  TensorArg args_[kMaxArgs];
  Role roles_[kMaxArgs] = {};
  int count_ = 0;
  DLDevice device_ = {kDLCPU, 0};
  const char* device_owner_ = nullptr;  // the argument that fixed device_
};

// "(2, 16, 64)", "(64,)" or "()" into buf; returns buf.
const char* format_shape(char* buf, size_t size, const int64_t* shape, int ndim);

}  // namespace ssm
