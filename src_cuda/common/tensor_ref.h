// The validated, framework-free view of a tensor that op implementations receive: data already
// offset by DLPack's byte_offset, the element type reduced to the three float types libssm
// computes with (or, for the index arguments an op asks for by DtypeRule::Index, int32/int64),
// and one stride per axis in elements, in the axis order the op documents.
#pragma once

#include <cstdint>

namespace ssm {

enum class Dtype : int32_t { F32 = 0, F16 = 1, BF16 = 2, I32 = 3, I64 = 4 };

inline const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::F32: return "float32";
    case Dtype::F16: return "float16";
    case Dtype::BF16: return "bfloat16";
    case Dtype::I32: return "int32";
    default: return "int64";
  }
}

struct TensorRef {
  void* data = nullptr;  // nullptr: the optional tensor is absent
  Dtype dtype = Dtype::F32;
  int64_t stride[4] = {0, 0, 0, 0};

  // constexpr so device code may call it too (the build passes --expt-relaxed-constexpr).
  constexpr bool present() const { return data != nullptr; }
};

}  // namespace ssm
