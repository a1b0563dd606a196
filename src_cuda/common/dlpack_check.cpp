// The checks behind TensorChecker (dlpack_check.h) and the message formatting they share.
#include "dlpack_check.h"

#include <utility>
#include <cstdio>
#include <cstring>

namespace ssm {

namespace {

void format_dtype(char* buf, size_t size, DLDataType t) {
  const char* base = nullptr;
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLComplex: base = "complex"; break;
    case kDLBool: base = "bool"; break;
    default: break;
  }
  int n;
  if (base == nullptr)
    n = std::snprintf(buf, size, "dtype(code=%u, bits=%u)", unsigned(t.code), unsigned(t.bits));
  else if (t.code == kDLBool && t.bits == 8)
    n = std::snprintf(buf, size, "bool");
  else
    n = std::snprintf(buf, size, "%s%u", base, unsigned(t.bits));
  if (t.lanes != 1 && n > 0 && size_t(n) < size)
    std::snprintf(buf + n, size - size_t(n), "x%u", unsigned(t.lanes));
}

void format_device(char* buf, size_t size, DLDevice d) {
  switch (int(d.device_type)) {
    case kDLCPU: std::snprintf(buf, size, "cpu"); break;
    case kDLCUDA: std::snprintf(buf, size, "cuda:%d", int(d.device_id)); break;
    case kDLCUDAHost: std::snprintf(buf, size, "cuda_host:%d", int(d.device_id)); break;
    case kDLCUDAManaged: std::snprintf(buf, size, "cuda_managed:%d", int(d.device_id)); break;
    default:
      std::snprintf(buf, size, "DLPack device type %d (id %d)", int(d.device_type),
                    int(d.device_id));
  }
}

bool to_dtype(DLDataType t, Dtype* d) {
  if (t.lanes != 1) return false;
  if (t.code == kDLFloat && t.bits == 32) *d = Dtype::F32;
  else if (t.code == kDLFloat && t.bits == 16) *d = Dtype::F16;
  else if (t.code == kDLBfloat && t.bits == 16) *d = Dtype::BF16;
  else if (t.code == kDLInt && t.bits == 32) *d = Dtype::I32;
  else if (t.code == kDLInt && t.bits == 64) *d = Dtype::I64;
  else return false;
  return true;
}

int64_t element_size(Dtype d) {
  return d == Dtype::I64 ? 8 : d == Dtype::F32 || d == Dtype::I32 ? 4 : 2;
}

bool accepts(DtypeRule rule, Dtype d) {
  const bool index = d == Dtype::I32 || d == Dtype::I64;
  if (rule == DtypeRule::Index) return index;
  return !index && (rule == DtypeRule::AnyFloat || d == Dtype::F32);
}

const char* expected_dtypes(DtypeRule rule) {
  switch (rule) {
    case DtypeRule::Float32: return "float32";
    case DtypeRule::Index: return "int32 or int64";
    default: return "float32, float16 or bfloat16";
  }
}

// Axis strides in elements, with NULL strides read as compact row-major.
void strides_of(const DLTensor* t, int64_t* out) {
  int64_t running = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    out[i] = t->strides != nullptr ? t->strides[i] : running;
    running *= t->shape[i];
  }
}

// The half-open byte range [lo, hi) that a tensor with at least one element touches.
struct Span {
  __int128 lo = 0, hi = 0;
  bool empty = true;
};

Span span_of(const DLTensor* t, const int64_t* stride, int64_t elem) {
  Span s;
  for (int i = 0; i < t->ndim; ++i)
    if (t->shape[i] == 0) return s;
  const __int128 base =
      __int128(reinterpret_cast<uintptr_t>(t->data)) + __int128(t->byte_offset);
  __int128 lo = 0, hi = 0;
  for (int i = 0; i < t->ndim; ++i) {
    const __int128 reach = __int128(stride[i]) * (t->shape[i] - 1) * elem;
    if (reach < 0) lo += reach;
    else hi += reach;
  }
  s.lo = base + lo;
  s.hi = base + hi + elem;
  s.empty = false;
  return s;
}

// Outputs are written element by element: two indices that reach the same address would race
// on a GPU and make the result depend on the write order.
ssm_status check_no_self_overlap(const char* name, const DLTensor* t, const int64_t* stride) {
  int axes[kMaxTensorDims];
  int n = 0;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] <= 1) continue;
    if (stride[i] == 0)
      return fail(SSM_ERROR_LAYOUT,
                  "%s: stride 0 on axis %d (extent %lld) would write %lld elements to one address",
                  name, i, (long long)t->shape[i], (long long)t->shape[i]);
    if (stride[i] < 0)
      return fail(SSM_ERROR_LAYOUT,
                  "%s: negative stride %lld on axis %d; outputs need positive strides", name,
                  (long long)stride[i], i);
    axes[n++] = i;
  }
  for (int k = 1; k < n; ++k)  // insertion sort by stride: at most four axes
    for (int j = k; j > 0 && stride[axes[j]] < stride[axes[j - 1]]; --j)
      std::swap(axes[j], axes[j - 1]);
  for (int k = 1; k < n; ++k) {
    const int prev = axes[k - 1], cur = axes[k];
    if (__int128(stride[cur]) < __int128(stride[prev]) * t->shape[prev]) {
      char shape_buf[128], stride_buf[128];
      format_shape(shape_buf, sizeof shape_buf, t->shape, t->ndim);
      format_shape(stride_buf, sizeof stride_buf, stride, t->ndim);
      return fail(SSM_ERROR_LAYOUT,
                  "%s: strides %s for shape %s make elements overlap; an output needs distinct "
                  "memory for every element",
                  name, stride_buf, shape_buf);
    }
  }
  return SSM_SUCCESS;
}

}  // namespace

const char* format_shape(char* buf, size_t size, const int64_t* shape, int ndim) {
  size_t used = 0;
  auto put = [&](const char* fmt, long long v) {
    if (used >= size) return;
    const int n = std::snprintf(buf + used, size - used, fmt, v);
    if (n > 0) used += size_t(n);
  };
  put("(", 0);
  for (int i = 0; i < ndim; ++i) put(i == 0 ? "%lld" : ", %lld", (long long)shape[i]);
  put(ndim == 1 ? ",)" : ")", 0);
  return buf;
}

TensorRef TensorArg::ref(std::initializer_list<int> axes) const {
  TensorRef r;
  if (t == nullptr) return r;
  r.data = data;
  r.dtype = dtype;
  int i = 0;
  for (int axis : axes) r.stride[i++] = axis < 0 ? 0 : stride[axis];
  return r;
}

ssm_status TensorChecker::add(const DLTensor* t, const char* name, bool required,
                              DtypeRule rule, Role role, TensorArg* arg) {
  *arg = TensorArg();
  arg->name = name;
  if (t == nullptr) {
    if (required) return fail(SSM_ERROR_INVALID_ARGUMENT, "%s: must not be NULL", name);
    return SSM_SUCCESS;
  }
  if (count_ == kMaxArgs)
    return fail(SSM_ERROR_INTERNAL, "%s: too many tensor arguments for one check", name);

  char got[64], want[64];
  const int type = int(t->device.device_type);
  if (type != kDLCPU && type != kDLCUDA) {
    format_device(got, sizeof got, t->device);
    return fail(SSM_ERROR_DEVICE, "%s: tensors on %s are not supported; expected cpu or cuda",
                name, got);
  }
  if (device_owner_ == nullptr) {
    device_ = t->device;
    device_owner_ = name;
  } else if (type != int(device_.device_type) ||
             (type == kDLCUDA && t->device.device_id != device_.device_id)) {
    // CPU device ids carry no meaning (frameworks number host devices freely), so only CUDA
    // tensors must agree on theirs.
    format_device(got, sizeof got, t->device);
    format_device(want, sizeof want, device_);
    return fail(SSM_ERROR_DEVICE,
                "%s: is on %s, but %s is on %s; all tensors must be on one device", name, got,
                device_owner_, want);
  }

  Dtype d;
  if (!to_dtype(t->dtype, &d) || !accepts(rule, d)) {
    format_dtype(got, sizeof got, t->dtype);
    return fail(SSM_ERROR_DTYPE, "%s: expected dtype %s, got %s", name, expected_dtypes(rule),
                got);
  }

  if (t->ndim < 0) return fail(SSM_ERROR_SHAPE, "%s: ndim is %d", name, int(t->ndim));
  if (t->ndim > 0 && t->shape == nullptr)
    return fail(SSM_ERROR_INVALID_ARGUMENT, "%s: shape is NULL with ndim %d", name, int(t->ndim));
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0) {
      char shape_buf[128];
      format_shape(shape_buf, sizeof shape_buf, t->shape, t->ndim < 8 ? t->ndim : 8);
      return fail(SSM_ERROR_SHAPE, "%s: shape %s has a negative extent", name, shape_buf);
    }
  }

  arg->t = t;
  arg->dtype = d;
  arg->data = t->data != nullptr ? static_cast<char*>(t->data) + t->byte_offset : nullptr;
  if (t->ndim <= kMaxTensorDims) strides_of(t, arg->stride);
  args_[count_] = *arg;
  roles_[count_] = role;
  ++count_;
  return SSM_SUCCESS;
}

ssm_status TensorChecker::expect_shape(const TensorArg& arg,
                                       std::initializer_list<const char*> dims,
                                       std::initializer_list<int64_t> extents) const {
  const DLTensor* t = arg.t;
  const int ndim = int(extents.size());
  bool ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; ++i) {
    const int64_t e = extents.begin()[i];
    ok = e < 0 || t->shape[i] == e;
  }
  if (ok) return SSM_SUCCESS;

  char names[160], want[160], got[160];
  size_t nu = 0, wu = 0;
  auto put = [](char* buf, size_t& used, size_t size, const char* s) {
    if (used >= size) return;
    const int n = std::snprintf(buf + used, size - used, "%s", s);
    if (n > 0) used += size_t(n);
  };
  put(names, nu, sizeof names, "(");
  put(want, wu, sizeof want, "(");
  for (int i = 0; i < ndim; ++i) {
    const char* sep = i == 0 ? "" : ", ";
    put(names, nu, sizeof names, sep);
    put(names, nu, sizeof names, dims.begin()[i]);
    put(want, wu, sizeof want, sep);
    char num[32];
    const int64_t e = extents.begin()[i];
    if (e < 0) put(want, wu, sizeof want, dims.begin()[i]);
    else {
      std::snprintf(num, sizeof num, "%lld", (long long)e);
      put(want, wu, sizeof want, num);
    }
  }
  put(names, nu, sizeof names, ndim == 1 ? ",)" : ")");
  put(want, wu, sizeof want, ndim == 1 ? ",)" : ")");
  format_shape(got, sizeof got, t->shape, t->ndim < 8 ? t->ndim : 8);
  bool any_known = false;
  for (int64_t e : extents) any_known |= e >= 0;
  // With no extent known yet (the first tensor read) the "= (...)" would only repeat the names.
  if (!any_known) return fail(SSM_ERROR_SHAPE, "%s: expected shape %s, got %s", arg.name, names, got);
  return fail(SSM_ERROR_SHAPE, "%s: expected shape %s = %s, got %s", arg.name, names, want, got);
}

ssm_status TensorChecker::check_memory() const {
  Span spans[kMaxArgs];
  for (int i = 0; i < count_; ++i) {
    const TensorArg& a = args_[i];
    const DLTensor* t = a.t;
    if (t->ndim > kMaxTensorDims)
      return fail(SSM_ERROR_INTERNAL, "%s: ndim %d was not checked", a.name, int(t->ndim));
    const int64_t elem = element_size(a.dtype);
    int64_t numel = 1;
    bool overflow = false;
    for (int k = 0; k < t->ndim; ++k)
      overflow |= __builtin_mul_overflow(numel, t->shape[k], &numel);
    if (overflow || __builtin_mul_overflow(numel, elem, &numel)) {
      char shape_buf[128];
      format_shape(shape_buf, sizeof shape_buf, t->shape, t->ndim);
      return fail(SSM_ERROR_SHAPE, "%s: shape %s is too large to address", a.name, shape_buf);
    }
    numel /= elem;
    if (numel > 0 && t->data == nullptr)
      return fail(SSM_ERROR_INVALID_ARGUMENT, "%s: data is NULL, but the tensor has %lld elements",
                  a.name, (long long)numel);
    if (numel > 0 && reinterpret_cast<uintptr_t>(a.data) % uintptr_t(elem) != 0)
      return fail(SSM_ERROR_LAYOUT,
                  "%s: data + byte_offset = %p is not aligned to its %lld-byte %s elements",
                  a.name, a.data, (long long)elem, dtype_name(a.dtype));
    // An empty output writes nothing, so its strides (NumPy gives 0 for every axis) cannot race.
    if (roles_[i] == Role::Output && numel > 0)
      SSM_RETURN_IF_ERROR(check_no_self_overlap(a.name, t, a.stride));
    spans[i] = span_of(t, a.stride, elem);
  }
  // Conservative on purpose: interleaved views (x[..., ::2] and x[..., 1::2]) share a byte range
  // without sharing an element, but telling them apart is not worth the risk of a missed race.
  for (int i = 0; i < count_; ++i) {
    if (roles_[i] != Role::Output || spans[i].empty) continue;
    for (int j = 0; j < count_; ++j) {
      if (j == i || spans[j].empty) continue;
      if (roles_[j] == Role::Output && j > i) continue;  // each pair of outputs is reported once
      if (spans[i].lo < spans[j].hi && spans[j].lo < spans[i].hi)
        return fail(SSM_ERROR_LAYOUT, "%s: its memory overlaps %s %s; outputs must not alias %s",
                    args_[i].name, roles_[j] == Role::Input ? "input" : "output", args_[j].name,
                    roles_[j] == Role::Input ? "inputs" : "each other");
    }
  }
  return SSM_SUCCESS;
}

}  // namespace ssm
