// IEEE 754 binary16 <-> binary32 conversions on bit patterns, for the CPU reference. Rounding is
// to nearest even, subnormals are kept, NaNs stay NaN (quietened) and overflow goes to infinity,
// matching the GPU's cvt.rn.f16.f32.
#include "half_host.h"

namespace ssm {

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_to_float(sign);
  // Subnormal: shift the leading one up to the implicit-bit position, lowering the exponent.
  uint32_t e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_to_float(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

uint16_t float_to_f16(float f) {
  uint32_t x = float_to_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  // 65520 is halfway between 65504 (the largest half) and 65536; the tie rounds to the even
  // neighbour, which is infinity.
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (x >= 0x38800000u) {
    // Normal half: rebias the exponent by (15 - 127) and round the 13 dropped bits to even.
    x += 0xc8000fffu + ((x >> 13) & 1u);
    return uint16_t(sign | (x >> 13));
  }
  // 2^-25 is halfway between 0 and the smallest subnormal 2^-24; the tie rounds to 0.
  if (x <= 0x33000000u) return sign;
  const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - (x >> 23);  // 14..24 for the subnormal range
  uint32_t h = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (h & 1u))) ++h;  // may carry into the smallest normal
  return uint16_t(sign | h);
}

}  // namespace ssm
