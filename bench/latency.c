/* bench latency: the time of one waiting request (dispatch_device_sync,
 * and dispatch_tensor_read of a 1-element tensor) on a REMOTE device,
 * against a raw TCP ping-pong of 16-byte messages (the frame header size)
 * on loopback with TCP_NODELAY, measured in the same run. The raw echo
 * server is a child process, as dispatch-server is another process than
 * its client.
 *
 * The three are measured in interleaved blocks so that noise from the
 * shared machine falls on all of them alike; median and p99 are taken
 * over every sample.
 */
#include "bench.h"

#define ROUNDS 20
#define PER_BLOCK 500
#define WARMUP 200

static double *samples(int n) {
  double *v = malloc((size_t)n * sizeof *v);
  if (!v) {
    fprintf(stderr, "latency: out of memory\n");
    exit(1);
  }
  return v;
}

int main(void) {
  bench_raw raw;
  if (bench_raw_start(&raw, 64) < 0) {
    fprintf(stderr, "latency: raw echo server: %s\n", strerror(errno));
    return 1;
  }
  int fd = bench_raw_connect(&raw);
  if (fd < 0) {
    fprintf(stderr, "latency: connect raw: %s\n", strerror(errno));
    return 1;
  }
  char why[512] = "";
  dispatch_device *dev = bench_open(bench_remote_spec(), why, sizeof why);
  dispatch_tensor *one = NULL;
  float val = 1.5f, got = 0;
  if (dev) {
    int64_t shape[1] = {1};
    int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, &val,
                                       sizeof val, &one);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (rc < 0) {
      snprintf(why, sizeof why, "upload: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
      dispatch_tensor_free(one);
      dispatch_device_close(dev);
      dev = NULL;
      one = NULL;
    }
  }

  int total = ROUNDS * PER_BLOCK, n_raw = 0, n_sync = 0, n_read = 0;
  double *t_raw = samples(total), *t_sync = samples(total),
         *t_read = samples(total);
  int failed = 0;

  for (int i = 0; i < WARMUP; i++) {
    if (bench_raw_call(fd, BENCH_RAW_ECHO, NULL, 0) < 0) failed = 1;
    if (dev) {
      dispatch_device_sync(dev);
      dispatch_tensor_read(one, &got, sizeof got);
    }
  }
  for (int r = 0; r < ROUNDS && !failed; r++) {
    for (int i = 0; i < PER_BLOCK; i++) {
      double t0 = bench_now();
      if (bench_raw_call(fd, BENCH_RAW_ECHO, NULL, 0) < 0) {
        failed = 1;
        break;
      }
      t_raw[n_raw++] = (bench_now() - t0) * 1e6;
    }
    for (int i = 0; dev && i < PER_BLOCK; i++) {
      double t0 = bench_now();
      int rc = dispatch_device_sync(dev);
      double dt = (bench_now() - t0) * 1e6;
      if (rc < 0) {
        snprintf(why, sizeof why, "sync: %s: %s", dispatch_err_name(rc),
                 dispatch_device_errmsg(dev));
        failed = 1;
        break;
      }
      t_sync[n_sync++] = dt;
    }
    for (int i = 0; dev && !failed && i < PER_BLOCK; i++) {
      double t0 = bench_now();
      int rc = dispatch_tensor_read(one, &got, sizeof got);
      double dt = (bench_now() - t0) * 1e6;
      if (rc < 0 || got != val) {
        snprintf(why, sizeof why, "read: %s: %s (value %g)",
                 dispatch_err_name(rc), dispatch_device_errmsg(dev),
                 (double)got);
        failed = 1;
        break;
      }
      t_read[n_read++] = dt;
    }
  }
  if (failed) fprintf(stderr, "latency: %s\n", why[0] ? why : "raw failed");

  /* copies: bench_quantile sorts in place and each array is used twice */
  double raw_med = bench_median(t_raw, n_raw);
  double raw_p99 = bench_quantile(t_raw, n_raw, 0.99);
  double sync_med = bench_median(t_sync, n_sync);
  double sync_p99 = bench_quantile(t_sync, n_sync, 0.99);
  double read_med = bench_median(t_read, n_read);
  double read_p99 = bench_quantile(t_read, n_read, 0.99);
  const char *ref = "raw TCP ping-pong 16 B";
  const char *note = why[0] ? why : NULL;
  bench_row("latency", "sync median", n_sync ? sync_med : NAN, "us", ref,
            raw_med, BENCH_GOAL_RATIO_LE, 1.3, note);
  bench_row("latency", "sync p99", n_sync ? sync_p99 : NAN, "us", ref,
            raw_p99, BENCH_GOAL_NONE, 0, note);
  bench_row("latency", "read 1-elem f32 median", n_read ? read_med : NAN,
            "us", ref, raw_med, BENCH_GOAL_RATIO_LE, 1.3, note);
  bench_row("latency", "read 1-elem f32 p99", n_read ? read_p99 : NAN, "us",
            ref, raw_p99, BENCH_GOAL_NONE, 0, note);

  free(t_raw);
  free(t_sync);
  free(t_read);
  dispatch_tensor_free(one);
  dispatch_device_close(dev);
  close(fd);
  bench_raw_stop(&raw);
  return failed;
}
