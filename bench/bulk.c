/* bench bulk: upload and download bandwidth of 4 KiB, 1 MiB, 64 MiB and
 * 256 MiB f32 tensors on a REMOTE device, against a raw loopback socket
 * moving the same bytes (16-byte header, then the payload, as a dispatch
 * frame does) and against memcpy, all in this process run.
 *
 * upload   = dispatch_tensor_from_data + dispatch_device_sync (the server
 *            has the bytes in storage when sync returns)
 * download = dispatch_tensor_read of a tensor already on the server
 * raw      = PUT: header + payload, the receiver reads it all into a
 *            buffer and answers a header; GET: header, payload back.
 *            A diagnostic row for the large sizes has the receiver
 *            malloc a fresh buffer per PUT, to show what page faults on
 *            fresh memory cost by themselves.
 *
 * Variants run interleaved per repetition and each figure is the median
 * time of its repetitions (bandwidth = bytes / median time). Also: the
 * speed of OpenSSL's AES-128-GCM and AES-256-GCM through EVP (TLS record
 * sized, 16 KiB), and 64 MiB up and down over tls:// against it (the
 * server named by DISPATCH_BENCH_TLS, which scripts/bench.sh starts).
 */
#include <openssl/evp.h>

#include "bench.h"

#define MAX_REPS 64

typedef struct size_case {
  const char *name;
  size_t bytes;
  int reps;       /* at most */
  double budget;  /* seconds for all variants of this size */
} size_case;

static const size_case SIZES[] = {
    {"4 KiB", 4096, MAX_REPS, 1.0},
    {"1 MiB", 1 << 20, MAX_REPS, 2.0},
    {"64 MiB", 64u << 20, 9, 6.0},
    {"256 MiB", 256u << 20, 5, 14.0},
};
#define NSIZES ((int)(sizeof SIZES / sizeof SIZES[0]))

/* small sizes: one sample is the mean of this many transfers, so the
 * timer and scheduler jitter do not dominate */
static int inner_count(size_t bytes) {
  return bytes <= 4096 ? 200 : bytes <= (1 << 20) ? 8 : 1;
}

/* MB/s of nbytes per time t */
static double mbps(size_t nbytes, double t) {
  return t > 0 ? (double)nbytes / t / 1e6 : NAN;
}

/* Encrypts `total` bytes as 16 KiB GCM records (new IV each, tag read),
 * the way TLS 1.3 does; returns MB/s (median of 3) or NAN. */
static double aes_gcm_mbps(const EVP_CIPHER *cipher, unsigned char *in,
                           unsigned char *out, size_t total) {
  unsigned char key[32] = {1, 2, 3}, iv[12] = {0}, tag[16];
  double t[3];
  EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
  if (!c) return NAN;
  if (EVP_EncryptInit_ex(c, cipher, NULL, key, iv) != 1) {
    EVP_CIPHER_CTX_free(c);
    return NAN;
  }
  const size_t rec = 16384;
  for (int r = 0; r < 3; r++) {
    double t0 = bench_now();
    for (size_t off = 0; off + rec <= total; off += rec) {
      int len = 0;
      iv[0]++;
      if (EVP_EncryptInit_ex(c, NULL, NULL, NULL, iv) != 1 ||
          EVP_EncryptUpdate(c, out + off, &len, in + off, (int)rec) != 1 ||
          EVP_EncryptFinal_ex(c, out + off + len, &len) != 1 ||
          EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, 16, tag) != 1) {
        EVP_CIPHER_CTX_free(c);
        return NAN;
      }
    }
    t[r] = bench_now() - t0;
  }
  EVP_CIPHER_CTX_free(c);
  return mbps(total, bench_median(t, 3));
}

static void *xmalloc_touched(size_t n) {
  unsigned char *p = malloc(n);
  if (!p) {
    fprintf(stderr, "bulk: out of memory (%zu bytes)\n", n);
    exit(1);
  }
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 7);
  return p;
}

int main(void) {
  size_t maxb = SIZES[NSIZES - 1].bytes;
  bench_raw raw;
  if (bench_raw_start(&raw, maxb) < 0) {
    fprintf(stderr, "bulk: raw server: %s\n", strerror(errno));
    return 1;
  }
  int fd = bench_raw_connect(&raw);
  if (fd < 0) {
    fprintf(stderr, "bulk: connect raw: %s\n", strerror(errno));
    return 1;
  }
  unsigned char *src = xmalloc_touched(maxb), *dst = xmalloc_touched(maxb);
  char why[512] = "";
  dispatch_device *dev = bench_open(bench_remote_spec(), why, sizeof why);
  double raw64_put = NAN;

  for (int s = 0; s < NSIZES; s++) {
    const size_case *sc = &SIZES[s];
    size_t n = sc->bytes;
    int inner = inner_count(n);
    int64_t shape[1] = {(int64_t)(n / 4)};
    double t_put[MAX_REPS], t_get[MAX_REPS], t_mem[MAX_REPS],
        t_up[MAX_REPS], t_down[MAX_REPS], t_fresh[MAX_REPS];
    int reps = 0, ok = dev != NULL;
    char fail[512] = "";
    dispatch_tensor *held = NULL;
    if (ok) {
      int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, src, n,
                                         &held);
      if (rc == 0) rc = dispatch_device_sync(dev);
      if (rc < 0) {
        snprintf(fail, sizeof fail, "upload %s: %s: %s", sc->name,
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
        ok = 0;
      }
    } else {
      snprintf(fail, sizeof fail, "%s", why);
    }
    double start = bench_now();
    /* one warm-up repetition (r = -1) is measured and dropped */
    for (int r = -1; r < sc->reps; r++) {
      if (r >= 3 && bench_now() - start > sc->budget) break;
      double t0 = bench_now();
      for (int i = 0; i < inner; i++)
        if (bench_raw_call(fd, BENCH_RAW_PUT, src, n) < 0) goto raw_fail;
      double tput = (bench_now() - t0) / inner;
      t0 = bench_now();
      for (int i = 0; i < inner; i++)
        if (bench_raw_call(fd, BENCH_RAW_GET, dst, n) < 0) goto raw_fail;
      double tget = (bench_now() - t0) / inner;
      t0 = bench_now();
      for (int i = 0; i < inner; i++)
        if (bench_raw_call(fd, BENCH_RAW_PUT_FRESH, src, n) < 0) goto raw_fail;
      double tfresh = (bench_now() - t0) / inner;
      t0 = bench_now();
      for (int i = 0; i < inner; i++) {
        memcpy(dst, src, n);
        __asm__ volatile("" : : "r"(dst) : "memory");
      }
      double tmem = (bench_now() - t0) / inner;
      double tup = NAN, tdown = NAN;
      if (ok) {
        t0 = bench_now();
        for (int i = 0; i < inner && ok; i++) {
          dispatch_tensor *t = NULL;
          int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, src,
                                             n, &t);
          if (rc == 0) rc = dispatch_device_sync(dev);
          dispatch_tensor_free(t);
          if (rc < 0) {
            snprintf(fail, sizeof fail, "upload %s: %s: %s", sc->name,
                     dispatch_err_name(rc), dispatch_device_errmsg(dev));
            ok = 0;
          }
        }
        tup = (bench_now() - t0) / inner;
        t0 = bench_now();
        for (int i = 0; i < inner && ok; i++) {
          int rc = dispatch_tensor_read(held, dst, n);
          if (rc < 0) {
            snprintf(fail, sizeof fail, "read %s: %s: %s", sc->name,
                     dispatch_err_name(rc), dispatch_device_errmsg(dev));
            ok = 0;
          }
        }
        tdown = (bench_now() - t0) / inner;
        if (ok && memcmp(dst, src, n) != 0) {
          snprintf(fail, sizeof fail, "read %s: bytes differ from upload",
                   sc->name);
          ok = 0;
        }
      }
      if (r < 0) continue;
      t_put[reps] = tput;
      t_fresh[reps] = tfresh;
      t_get[reps] = tget;
      t_mem[reps] = tmem;
      t_up[reps] = tup;
      t_down[reps] = tdown;
      reps++;
    }
    dispatch_tensor_free(held);
    if (fail[0]) fprintf(stderr, "bulk: %s\n", fail);

    double put = mbps(n, bench_median(t_put, reps));
    double get = mbps(n, bench_median(t_get, reps));
    double mem = mbps(n, bench_median(t_mem, reps));
    double fresh = mbps(n, bench_median(t_fresh, reps));
    double up = ok ? mbps(n, bench_median(t_up, reps)) : NAN;
    double down = ok ? mbps(n, bench_median(t_down, reps)) : NAN;
    if (n == (64u << 20)) raw64_put = put;
    /* 4 KiB is a latency-bound size, not bulk: no goal there */
    bench_goal g = n >= (1u << 20) ? BENCH_GOAL_RATIO_GE : BENCH_GOAL_NONE;
    char m[96];
    const char *note = fail[0] ? fail : NULL;
    snprintf(m, sizeof m, "upload %s", sc->name);
    bench_row("bulk", m, up, "MB/s", "raw socket", put, g, 0.7, note);
    snprintf(m, sizeof m, "upload %s vs memcpy", sc->name);
    bench_row("bulk", m, up, "MB/s", "memcpy", mem, BENCH_GOAL_NONE, 0, note);
    if (n >= (64u << 20)) {
      snprintf(m, sizeof m, "raw socket %s into fresh malloc", sc->name);
      bench_row("bulk", m, fresh, "MB/s", "raw socket", put, BENCH_GOAL_NONE,
                0, "diagnostic: receiver allocates per transfer (faults)");
    }
    snprintf(m, sizeof m, "download %s", sc->name);
    bench_row("bulk", m, down, "MB/s", "raw socket", get, g, 0.7, note);
    snprintf(m, sizeof m, "download %s vs memcpy", sc->name);
    bench_row("bulk", m, down, "MB/s", "memcpy", mem, BENCH_GOAL_NONE, 0,
              note);
    continue;
  raw_fail:
    fprintf(stderr, "bulk: raw transfer of %s failed\n", sc->name);
    return 1;
  }

  /* OpenSSL's own cipher speed on one core: the limit of a TLS stream */
  size_t aes_bytes = 64u << 20;
  double a128 = aes_gcm_mbps(EVP_aes_128_gcm(), src, dst, aes_bytes);
  double a256 = aes_gcm_mbps(EVP_aes_256_gcm(), src, dst, aes_bytes);
  bench_row("bulk", "AES-128-GCM encrypt (EVP; 16 KiB records)", a128, "MB/s",
            "raw socket 64 MiB", raw64_put, BENCH_GOAL_NONE, 0,
            "reference for TLS: one core's cipher speed");
  bench_row("bulk", "AES-256-GCM encrypt (EVP; 16 KiB records)", a256, "MB/s",
            "raw socket 64 MiB", raw64_put, BENCH_GOAL_NONE, 0,
            "reference for TLS: one core's cipher speed");

  /* 64 MiB up and down over tls:// (TLS 1.3 negotiates AES-256-GCM), each
   * against the cipher's own speed */
  const char *tls = getenv("DISPATCH_BENCH_TLS");
  char twhy[512] = "";
  dispatch_device *tdev = tls ? bench_open(tls, twhy, sizeof twhy) : NULL;
  if (!tls) snprintf(twhy, sizeof twhy, "no TLS server (DISPATCH_BENCH_TLS)");
  size_t n = 64u << 20;
  int64_t shape[1] = {(int64_t)(n / 4)};
  double tu[5], td[5];
  int ku = 0, kd = 0;
  for (int r = 0; tdev && r < 5; r++) {
    dispatch_tensor *x = NULL;
    double t0 = bench_now();
    int rc = dispatch_tensor_from_data(tdev, DISPATCH_F32, 1, shape, src, n,
                                       &x);
    if (rc == 0) rc = dispatch_device_sync(tdev);
    double t1 = bench_now();
    if (rc == 0) rc = dispatch_tensor_read(x, dst, n);
    double t2 = bench_now();
    dispatch_tensor_free(x);
    if (rc == 0 && memcmp(src, dst, n) != 0) {
      snprintf(twhy, sizeof twhy, "tls: bytes read back differ");
      break;
    }
    if (rc < 0) {
      snprintf(twhy, sizeof twhy, "tls: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(tdev));
      break;
    }
    tu[ku++] = t1 - t0;
    td[kd++] = t2 - t1;
  }
  bench_row("bulk", "TLS upload 64 MiB", ku ? mbps(n, bench_median(tu, ku)) : NAN,
            "MB/s", "AES-256-GCM one core", a256, BENCH_GOAL_NONE, 0,
            twhy[0] ? twhy : NULL);
  bench_row("bulk", "TLS download 64 MiB",
            kd ? mbps(n, bench_median(td, kd)) : NAN, "MB/s",
            "AES-256-GCM one core", a256, BENCH_GOAL_NONE, 0,
            twhy[0] ? twhy : NULL);
  dispatch_device_close(tdev);

  dispatch_device_close(dev);
  free(src);
  free(dst);
  close(fd);
  bench_raw_stop(&raw);
  return 0;
}
