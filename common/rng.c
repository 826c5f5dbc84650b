/* Counter-based generator; the formulas are spelled out in rng.h. */
#include "rng.h"

#include <math.h>

#define DSP_RNG_GOLDEN UINT64_C(0x9E3779B97F4A7C15)

static inline uint64_t rng_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}

uint64_t dsp_rng_u64(uint64_t seed, uint64_t i) {
  return rng_mix(rng_mix(seed + DSP_RNG_GOLDEN) + (i + 1) * DSP_RNG_GOLDEN);
}

double dsp_rng_uniform01(uint64_t seed, uint64_t i) {
  return (double)(dsp_rng_u64(seed, i) >> 11) * 0x1.0p-53;
}

void dsp_rng_normal_pair(uint64_t seed, uint64_t k, double *z0, double *z1) {
  double u1 = dsp_rng_uniform01(seed, 2 * k);
  double u2 = dsp_rng_uniform01(seed, 2 * k + 1);
  double r = sqrt(-2.0 * log(1.0 - u1));
  double th = 6.283185307179586476925286766559 * u2;
  *z0 = r * cos(th);
  *z1 = r * sin(th);
}

double dsp_rng_normal(uint64_t seed, uint64_t i) {
  double z0, z1;
  dsp_rng_normal_pair(seed, i / 2, &z0, &z1);
  return (i & 1) ? z1 : z0;
}
