/* How make bench judges a row (bench/bench.h): a figure that beats the
 * limit it is measured against is flagged REF SUSPECT instead of counting
 * as a met goal; met and missed need the interquartile range of the paired
 * per-repetition ratios on one side of the goal, else the row is unclear
 * and its loop repeats; the variant order rotates. Synthetic samples: the
 * ratios are chosen, each reference sample differs, so only the pairing
 * ours[i] / ref[i] gives them back. */
#include <criterion/criterion.h>

#include "../bench/bench.h"

#define N 7

/* ours[i] = ratio[i] * ref[i], with references that vary per repetition */
static void make(const double *ratio, int n, double *ours, double *ref) {
  for (int i = 0; i < n; i++) {
    ref[i] = 100.0 + 37.0 * i;
    ours[i] = ratio[i] * ref[i];
  }
}

static const char *judge(const bench_def *d, const double *ratio, int n) {
  double ours[N], ref[N];
  make(ratio, n, ours, ref);
  return bench_verdict(d, bench_summarize(ours, ref, n));
}

static int unsettled(const bench_def *d, const double *ratio, int n) {
  double ours[N], ref[N];
  make(ratio, n, ours, ref);
  return bench_unsettled(d, ours, ref, n);
}

/* a bandwidth row against the raw socket, goal >= 0.9 */
static const bench_def RATE = {"bulk", "upload", "MB/s", 0, "raw socket", 1,
                               BENCH_GOAL_RATIO_GE, 0.9};
/* a latency row against a raw round trip, goal <= 1.3 */
static const bench_def TIME = {"latency", "sync", "us", 1, "raw", 1,
                               BENCH_GOAL_RATIO_LE, 1.3};

static void quiet(void) { unsetenv("BENCH_QUICK"); }

TestSuite(bench_verdict, .init = quiet);

Test(bench_verdict, beating_a_limit_is_suspect_not_met) {
  const double fast[N] = {1.2, 1.25, 1.3, 1.22, 1.28, 1.21, 1.24};
  cr_expect_str_eq(judge(&RATE, fast, N), "REF SUSPECT");
  const double quick_time[N] = {0.8, 0.7, 0.75, 0.82, 0.78, 0.8, 0.79};
  cr_expect_str_eq(judge(&TIME, quick_time, N), "REF SUSPECT");
  /* within 5% of the limit is fine, in either direction of figure */
  const double close[N] = {1.04, 1.03, 1.02, 1.04, 1.01, 1.03, 1.04};
  cr_expect_str_eq(judge(&RATE, close, N), "met");
  const double close_t[N] = {0.97, 0.98, 0.99, 0.96, 0.97, 0.98, 0.99};
  cr_expect_str_eq(judge(&TIME, close_t, N), "met");
  /* a reference that is no limit (a per-parameter variant, say) may be
   * beaten: no goal, no flag */
  bench_def cmp = RATE;
  cmp.ref_is_limit = 0;
  cmp.goal = BENCH_GOAL_NONE;
  cr_expect_str_eq(judge(&cmp, fast, N), "");
}

Test(bench_verdict, met_and_missed_need_the_whole_quartile_range) {
  const double above[N] = {0.92, 0.95, 0.97, 0.93, 0.99, 0.94, 0.91};
  cr_expect_str_eq(judge(&RATE, above, N), "met");
  const double below[N] = {0.5, 0.6, 0.55, 0.62, 0.58, 0.57, 0.61};
  cr_expect_str_eq(judge(&RATE, below, N), "missed");
  /* median above the goal, but a quarter of the repetitions below it */
  const double straddle[N] = {0.7, 0.8, 0.95, 0.96, 0.97, 0.85, 0.99};
  cr_expect_str_eq(judge(&RATE, straddle, N), "unclear");
  cr_expect(unsettled(&RATE, straddle, N));
  cr_expect(!unsettled(&RATE, above, N));
  cr_expect(!unsettled(&RATE, below, N));
  const double slow[N] = {1.5, 1.4, 1.45, 1.6, 1.42, 1.48, 1.5};
  cr_expect_str_eq(judge(&TIME, slow, N), "missed");
  const double ok[N] = {1.1, 1.2, 1.15, 1.12, 1.18, 1.1, 1.2};
  cr_expect_str_eq(judge(&TIME, ok, N), "met");
}

Test(bench_verdict, too_few_repetitions_carry_no_verdict) {
  const double above[N] = {0.95, 0.96, 0.97, 0.98, 0.99, 0.95, 0.96};
  cr_expect_str_eq(judge(&RATE, above, BENCH_MIN_VERDICT_REPS - 1),
                   "unclear");
  cr_expect_str_eq(judge(&RATE, above, BENCH_MIN_VERDICT_REPS), "met");
}

Test(bench_verdict, a_suspect_row_repeats_until_its_range_confirms_it) {
  /* median 1.2 but a quarter of the repetitions within the 5% line */
  const double shaky[N] = {0.9, 1.0, 1.2, 1.2, 1.25, 1.3, 1.0};
  cr_expect_str_eq(judge(&RATE, shaky, N), "REF SUSPECT");
  cr_expect(unsettled(&RATE, shaky, N));
  const double sure[N] = {1.2, 1.25, 1.3, 1.22, 1.28, 1.21, 1.24};
  cr_expect(!unsettled(&RATE, sure, N));
}

Test(bench_verdict, quick_mode_judges_nothing) {
  const double fast[N] = {1.2, 1.25, 1.3, 1.22, 1.28, 1.21, 1.24};
  setenv("BENCH_QUICK", "1", 1);
  cr_expect_str_eq(judge(&RATE, fast, N), "quick");
  cr_expect(!unsettled(&RATE, fast, N));
  unsetenv("BENCH_QUICK");
}

Test(bench_verdict, variant_order_rotates) {
  enum { NV = 4 };
  for (int r = 0; r < 8; r++) {
    int seen[NV] = {0};
    for (int k = 0; k < NV; k++) seen[bench_turn(r, k, NV)]++;
    for (int v = 0; v < NV; v++)
      cr_expect_eq(seen[v], 1, "repetition %d runs variant %d %d times", r, v,
                   seen[v]);
    /* no variant keeps its place from one repetition to the next */
    for (int k = 0; k < NV; k++)
      cr_expect_neq(bench_turn(r, k, NV), bench_turn(r + 1, k, NV));
  }
}

Test(bench_verdict, a_row_reports_medians_and_spread_of_paired_ratios) {
  const double ratio[5] = {0.5, 0.9, 0.7, 0.6, 0.8};
  double ours[5], ref[5];
  make(ratio, 5, ours, ref);
  bench_sum s = bench_summarize(ours, ref, 5);
  cr_expect_eq(s.n, 5);
  cr_expect_float_eq(s.ratio, 0.7, 1e-12);
  cr_expect_float_eq(s.rq1, 0.6, 1e-12);
  cr_expect_float_eq(s.rq3, 0.8, 1e-12);
  cr_expect_float_eq(s.omin, 50.0, 1e-9);   /* 0.5 * 100 */
  cr_expect_float_eq(s.omax, 0.8 * 248, 1e-9); /* the last repetition */
  cr_expect_float_eq(s.ref, 100.0 + 37.0 * 2, 1e-9);
}
