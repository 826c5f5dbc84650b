/* Counter-based random numbers: the same (seed, counter) gives the same
 * number on every machine, in any order and with any number of threads,
 * because element i of a random tensor depends only on (seed, i).
 *
 * Exact formulas (all arithmetic on uint64_t, wrapping mod 2^64):
 *
 *   mix(z):   z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
 *             z = (z ^ (z >> 27)) * 0x94D049BB133111EB
 *             return z ^ (z >> 31)            (the splitmix64 finalizer)
 *   G = 0x9E3779B97F4A7C15                    (the splitmix64 increment)
 *
 *   dsp_rng_u64(seed, i)      = mix(mix(seed + G) + (i + 1) * G)
 *     The seed is hashed first so that streams of neighbouring seeds are
 *     not shifted copies of one another.
 *   dsp_rng_uniform01(seed, i) = (dsp_rng_u64(seed, i) >> 11) * 2^-53
 *     53 random bits, exactly representable in a double, in [0, 1).
 *   dsp_rng_normal_pair(seed, k, &z0, &z1): Box-Muller on counters 2k and
 *     2k+1: u1 = uniform01(seed, 2k), u2 = uniform01(seed, 2k + 1),
 *     r = sqrt(-2 log(1 - u1)) (1 - u1 is in (0, 1], so the log is finite),
 *     z0 = r cos(2 pi u2), z1 = r sin(2 pi u2).
 *   dsp_rng_normal(seed, i) is z0 of pair i/2 for even i, z1 for odd i,
 *     so element 2k and 2k+1 of a normal tensor form one pair.
 *
 * The integer and uniform streams are bit-identical everywhere; normal
 * values also go through libm's log/sqrt/cos/sin, which are identical for
 * every process linked against the same libm (LOCAL and REMOTE on the same
 * system image). */
#ifndef DSP_RNG_H
#define DSP_RNG_H

#include <stdint.h>

uint64_t dsp_rng_u64(uint64_t seed, uint64_t i);
double dsp_rng_uniform01(uint64_t seed, uint64_t i);
void dsp_rng_normal_pair(uint64_t seed, uint64_t k, double *z0, double *z1);
double dsp_rng_normal(uint64_t seed, uint64_t i);

#endif
