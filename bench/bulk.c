/* bench bulk: upload and download bandwidth of f32 tensors on a REMOTE
 * device (4 KiB, 1 MiB, 64 MiB and 256 MiB; BENCH_QUICK: 4 KiB, 64 KiB,
 * 1 MiB, 4 MiB), against a raw loopback socket moving the same bytes
 * (16-byte header, then the payload, as a dispatch frame does) and
 * against memcpy, all in this process run.
 *
 * upload   = dispatch_tensor_from_data + dispatch_device_sync (the server
 *            has the bytes in storage when sync returns)
 * download = dispatch_tensor_read of a tensor already on the server
 * raw      = PUT: header + payload, the receiver reads it all into a
 *            buffer and answers a header; GET: header, payload back. The
 *            receiver is bench/raw_server, exec'd and placed by
 *            scripts/bench.sh exactly like dispatch-server, with the same
 *            allocator settings; its buffer is warm, as the server's
 *            storage cache is. The client side runs three times: with
 *            blocking reads and writes, waiting the way
 *            libdispatch-client does (non-blocking I/O, spinning
 *            DISPATCH_SPIN_US before every sleep, mid-payload too), and
 *            the same without the spin (as the client waits when its
 *            policy spins for nothing, client/wait.c); each row's
 *            reference is whichever of the three has the best median, so
 *            the limit is the best a plain socket does here.
 *            A diagnostic row for the two large sizes has the receiver
 *            malloc a fresh buffer per PUT, to show what page faults on
 *            fresh memory cost by themselves.
 * kept     = the largest size uploaded as 16 tensors of a 16th each, all
 *            kept live until the last one's sync, then freed (a step with
 *            many large tensors live: the storage cache must hold them
 *            all), against the best of the raw PUTs of the whole size and
 *            16 raw PUTs of the same parts (the same transfer pattern).
 *            Goal: at least 0.7 of it (issue 11).
 *
 * Every repetition runs all variants once, in an order that rotates by
 * one per repetition; rows are medians over repetitions with their spread
 * (bench.h). Repetitions go on (up to a cap and a time budget per size)
 * while a goal is neither met nor missed by the interquartile range of
 * the paired ratios. Goal: at least 0.9 of the raw socket from 1 MiB on.
 * bf16     = 16 Mi elements (BENCH_QUICK: 1 Mi) uploaded and read as bf16
 *            against the same element count as f32 in the same repetition
 *            (half the bytes: expect about half the time; goal at most
 *            0.6), and against the raw socket moving the bf16 bytes (goal
 *            0.9, as above). The bytes are the same pattern either way: a
 *            transfer does not look at them.
 * Also: OpenSSL's AES-128-GCM and AES-256-GCM through EVP (TLS record
 * sized, 16 KiB), and the large size up and down over tls:// against the
 * cipher in the same repetition (the server named by DISPATCH_BENCH_TLS).
 */
#include <openssl/evp.h>

#include "bench.h"

#define MAX_REPS 64
#define BULK_GOAL 0.9

typedef struct size_case {
  const char *name;
  size_t bytes;
  int reps;      /* at most */
  double budget; /* seconds for all variants of this size */
} size_case;

static const size_case SIZES[] = {
    {"4 KiB", 4096, MAX_REPS, 2.0},
    {"1 MiB", 1 << 20, MAX_REPS, 4.0},
    {"64 MiB", 64u << 20, 31, 12.0},
    {"256 MiB", 256u << 20, 15, 24.0},
};
static const size_case QUICK_SIZES[] = {
    {"4 KiB", 4096, 2, 0},
    {"64 KiB", 64u << 10, 2, 0},
    {"1 MiB", 1 << 20, 2, 0},
    {"4 MiB", 4u << 20, 2, 0},
};
#define NSIZES 4
#define MIN_REPS 5

/* small sizes: one sample is the mean of this many transfers, so the
 * timer and scheduler jitter do not dominate */
static int inner_count(size_t bytes) {
  return bytes <= 4096 ? 200 : bytes <= (1 << 20) ? 8 : 1;
}

/* MB/s of nbytes per time t */

/* Encrypts `total` bytes as 16 KiB GCM records (new IV each, tag read),
 * the way TLS 1.3 does; returns seconds or NAN. */
static double aes_gcm_time(const EVP_CIPHER *cipher, unsigned char *in,
                           unsigned char *out, size_t total) {
  unsigned char key[32] = {1, 2, 3}, iv[12] = {0}, tag[16];
  EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
  if (!c) return NAN;
  if (EVP_EncryptInit_ex(c, cipher, NULL, key, iv) != 1) {
    EVP_CIPHER_CTX_free(c);
    return NAN;
  }
  const size_t rec = 16384;
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
  double t = bench_now() - t0;
  EVP_CIPHER_CTX_free(c);
  return t;
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

/* times (s) -> MB/s, in place */
static void to_mbps(double *t, int n, size_t bytes) {
  for (int i = 0; i < n; i++) t[i] = bench_mbps(bytes, t[i]);
}

/* the variants of one repetition, in bench_turn's rotating order */
enum {
  V_PUT_BLOCK, V_PUT_CLIENT, V_PUT_POLL, V_GET_BLOCK, V_GET_CLIENT,
  V_GET_POLL, V_FRESH, V_MEMCPY, V_UP, V_DOWN, V_KEPT, V_PUT_PARTS, NVAR
};
#define KEPT_PARTS 16
#define KEPT_GOAL 0.7

typedef struct bulk_ctx {
  int fd; /* raw server connection, -1 when none */
  dispatch_device *dev;
  dispatch_tensor *held; /* the tensor downloads read */
  unsigned char *src, *dst;
  char fail[512];  /* dispatch failure: the rows say why */
  char rfail[512]; /* raw failure */
} bulk_ctx;

/* Runs variant v of one repetition (inner transfers of n bytes); returns
 * the mean seconds per transfer, NAN when it could not run. */
static double run_variant(bulk_ctx *c, int v, size_t n, int inner) {
  int64_t shape[1] = {(int64_t)(n / 4)};
  double t0 = bench_now();
  if (v == V_PUT_PARTS) { /* the kept row's pattern over the raw socket */
    if (c->fd < 0 || c->rfail[0]) return NAN;
    size_t pn = n / KEPT_PARTS;
    for (int i = 0; i < inner; i++)
      for (int k = 0; k < KEPT_PARTS; k++)
        if (bench_raw_call(c->fd, BENCH_RAW_PUT, c->src + (size_t)k * pn, pn,
                           BENCH_WAIT_BLOCK) < 0) {
          snprintf(c->rfail, sizeof c->rfail, "raw transfer failed: %s",
                   strerror(errno));
          return NAN;
        }
  } else if (v <= V_FRESH) {
    if (c->fd < 0 || c->rfail[0]) return NAN;
    uint32_t cmd = v <= V_PUT_POLL ? BENCH_RAW_PUT
                   : v == V_FRESH  ? BENCH_RAW_PUT_FRESH
                                   : BENCH_RAW_GET;
    bench_wait how = (v == V_PUT_CLIENT || v == V_GET_CLIENT) ? BENCH_WAIT_CLIENT
                     : (v == V_PUT_POLL || v == V_GET_POLL)   ? BENCH_WAIT_POLL
                                                              : BENCH_WAIT_BLOCK;
    void *buf = cmd == BENCH_RAW_GET ? (void *)c->dst : (void *)c->src;
    for (int i = 0; i < inner; i++)
      if (bench_raw_call(c->fd, cmd, buf, n, how) < 0) {
        snprintf(c->rfail, sizeof c->rfail, "raw transfer failed: %s",
                 strerror(errno));
        return NAN;
      }
  } else if (v == V_MEMCPY) {
    for (int i = 0; i < inner; i++) {
      memcpy(c->dst, c->src, n);
      __asm__ volatile("" : : "r"(c->dst) : "memory");
    }
  } else {
    if (!c->dev || c->fail[0]) return NAN;
    for (int i = 0; i < inner; i++) {
      int rc;
      if (v == V_KEPT) {
        dispatch_tensor *t[KEPT_PARTS] = {NULL};
        int64_t part[1] = {(int64_t)(n / 4 / KEPT_PARTS)};
        size_t pn = n / KEPT_PARTS;
        rc = 0;
        for (int k = 0; k < KEPT_PARTS && rc == 0; k++)
          rc = dispatch_tensor_from_data(c->dev, DISPATCH_F32, 1, part,
                                         c->src + (size_t)k * pn, pn, &t[k]);
        if (rc == 0) rc = dispatch_device_sync(c->dev);
        for (int k = 0; k < KEPT_PARTS; k++) dispatch_tensor_free(t[k]);
      } else if (v == V_UP) {
        dispatch_tensor *t = NULL;
        rc = dispatch_tensor_from_data(c->dev, DISPATCH_F32, 1, shape, c->src,
                                       n, &t);
        if (rc == 0) rc = dispatch_device_sync(c->dev);
        dispatch_tensor_free(t);
      } else {
        rc = dispatch_tensor_read(c->held, c->dst, n);
      }
      if (rc < 0) {
        snprintf(c->fail, sizeof c->fail, "%s %zu B: %s: %s",
                 v == V_DOWN ? "read" : "upload", n, dispatch_err_name(rc),
                 dispatch_device_errmsg(c->dev));
        return NAN;
      }
    }
    /* checked after the clock stops: the raw GET is not checked, and a
     * memcmp of 64 MiB took a third as long as the read it followed */
    double t = bench_now() - t0;
    if (v == V_DOWN && memcmp(c->dst, c->src, n) != 0) {
      snprintf(c->fail, sizeof c->fail, "read %zu B: bytes differ", n);
      return NAN;
    }
    return t / inner;
  }
  return (bench_now() - t0) / inner;
}

/* ------------------------------------------------------------------ */
/* bf16 against f32 of the same element count                         */

enum {
  H_UP32, H_UP16, H_DOWN32, H_DOWN16, H_PUT, H_PUT_CLIENT, H_PUT_POLL,
  H_GET, H_GET_CLIENT, H_GET_POLL, NHVAR
};
#define HALF_GOAL 0.6

/* One transfer of variant v over e elements (held[0]: the f32 tensor to
 * read, held[1]: the bf16 one); seconds, or NAN with the reason in c. */
static double run_half(bulk_ctx *c, int v, int64_t e, dispatch_tensor **held) {
  double t0 = bench_now();
  if (v >= H_PUT) {
    if (c->fd < 0 || c->rfail[0]) return NAN;
    int get = v >= H_GET;
    int w = (v - (get ? H_GET : H_PUT));
    bench_wait how = w == 0 ? BENCH_WAIT_BLOCK
                     : w == 1 ? BENCH_WAIT_CLIENT
                              : BENCH_WAIT_POLL;
    if (bench_raw_call(c->fd, get ? BENCH_RAW_GET : BENCH_RAW_PUT,
                       get ? (void *)c->dst : (void *)c->src, (size_t)e * 2,
                       how) < 0) {
      snprintf(c->rfail, sizeof c->rfail, "raw transfer failed: %s",
               strerror(errno));
      return NAN;
    }
    return bench_now() - t0;
  }
  if (!c->dev || c->fail[0]) return NAN;
  int half = v == H_UP16 || v == H_DOWN16;
  dispatch_dtype dt = half ? DISPATCH_BF16 : DISPATCH_F32;
  size_t n = (size_t)e * (half ? 2 : 4);
  int rc;
  if (v == H_UP32 || v == H_UP16) {
    dispatch_tensor *t = NULL;
    rc = dispatch_tensor_from_data(c->dev, dt, 1, &e, c->src, n, &t);
    if (rc == 0) rc = dispatch_device_sync(c->dev);
    dispatch_tensor_free(t);
  } else {
    rc = dispatch_tensor_read(held[half], c->dst, n);
  }
  double t = bench_now() - t0;
  if (rc == 0 && (v == H_DOWN32 || v == H_DOWN16) &&
      memcmp(c->dst, c->src, n) != 0) {
    snprintf(c->fail, sizeof c->fail, "%s read: bytes differ",
             half ? "bf16" : "f32");
    return NAN;
  }
  if (rc < 0) {
    snprintf(c->fail, sizeof c->fail, "%s %s: %s: %s", half ? "bf16" : "f32",
             v <= H_UP16 ? "upload" : "read", dispatch_err_name(rc),
             dispatch_device_errmsg(c->dev));
    return NAN;
  }
  return t;
}

/* The bf16 rows: each repetition runs every variant once in rotating
 * order; the raw reference is the best of the three waits, per row. */
static void half_rows(bulk_ctx *c, int quick) {
  int64_t e = quick ? (int64_t)1 << 20 : (int64_t)16 << 20;
  const char *en = quick ? "1 Mi" : "16 Mi";
  int max_reps = quick ? 2 : 31, reps = 0;
  static double t[NHVAR][MAX_REPS];
  dispatch_tensor *held[2] = {NULL, NULL};
  c->fail[0] = c->rfail[0] = '\0';
  for (int h = 0; h < 2 && c->dev; h++) {
    dispatch_dtype dt = h ? DISPATCH_BF16 : DISPATCH_F32;
    int rc = dispatch_tensor_from_data(c->dev, dt, 1, &e, c->src,
                                       (size_t)e * (h ? 2 : 4), &held[h]);
    if (rc == 0) rc = dispatch_device_sync(c->dev);
    if (rc < 0 && !c->fail[0])
      snprintf(c->fail, sizeof c->fail, "upload %s: %s: %s",
               h ? "bf16" : "f32", dispatch_err_name(rc),
               dispatch_device_errmsg(c->dev));
  }
  if (!c->dev) snprintf(c->fail, sizeof c->fail, "no server");
  bench_def vs32 = {"bulk", NULL, "ms", 1, "f32 same elements", 0,
                    BENCH_GOAL_RATIO_LE, HALF_GOAL};
  bench_def vsraw = {"bulk", NULL, "MB/s", 0, "raw socket", 1,
                     BENCH_GOAL_RATIO_GE, BULK_GOAL};
  double start = bench_now();
  for (int r = -1; r < max_reps; r++) {
    if (r >= 0) {
      int unsettled = 0;
      if (reps > 0) {
        double a[MAX_REPS], b[MAX_REPS];
        for (int d = 0; d < 2 && !unsettled; d++) {
          int o16 = d ? H_DOWN16 : H_UP16, o32 = d ? H_DOWN32 : H_UP32;
          unsettled = bench_unsettled(&vs32, t[o16], t[o32], reps);
          double *rv[3] = {t[d ? H_GET : H_PUT], t[d ? H_GET_CLIENT : H_PUT_CLIENT],
                           t[d ? H_GET_POLL : H_PUT_POLL]};
          int best = bench_best_variant(rv, 3, reps);
          for (int i = 0; i < reps; i++) {
            a[i] = 1 / t[o16][i];
            b[i] = 1 / rv[best][i];
          }
          unsettled = unsettled || bench_unsettled(&vsraw, a, b, reps);
        }
      }
      if (!bench_more(reps, quick ? max_reps : MIN_REPS, max_reps,
                      bench_now() - start, 12.0, unsettled))
        break;
    }
    double tv[NHVAR];
    for (int k = 0; k < NHVAR; k++) {
      int v = bench_turn(r, k, NHVAR);
      tv[v] = run_half(c, v, e, held);
    }
    if (r < 0) continue;
    for (int v = 0; v < NHVAR; v++) t[v][reps] = tv[v];
    reps++;
  }
  dispatch_tensor_free(held[0]);
  dispatch_tensor_free(held[1]);
  char m[96], note[1200];
  for (int d = 0; d < 2; d++) {
    const char *what = d ? "download" : "upload";
    int o16 = d ? H_DOWN16 : H_UP16, o32 = d ? H_DOWN32 : H_UP32;
    double ms16[MAX_REPS], ms32[MAX_REPS];
    for (int i = 0; i < reps; i++) {
      ms16[i] = t[o16][i] * 1e3;
      ms32[i] = t[o32][i] * 1e3;
    }
    snprintf(m, sizeof m, "bf16 %s %s elements vs f32", what, en);
    vs32.metric = m;
    bench_emit(&vs32, ms16, ms32, reps, "%s%shalf the bytes of the f32 row",
               c->fail, c->fail[0] ? "; " : "");
    double *rv[3] = {t[d ? H_GET : H_PUT], t[d ? H_GET_CLIENT : H_PUT_CLIENT],
                     t[d ? H_GET_POLL : H_PUT_POLL]};
    int best = bench_best_variant(rv, 3, reps);
    double ours[MAX_REPS], raw[MAX_REPS];
    for (int i = 0; i < reps; i++) {
      ours[i] = bench_mbps((size_t)e * 2, t[o16][i]);
      raw[i] = bench_mbps((size_t)e * 2, rv[best][i]);
    }
    snprintf(note, sizeof note, "%s%s%s%sraw reference: %s wait, %lld bytes",
             c->fail, c->fail[0] ? "; " : "", c->rfail,
             c->rfail[0] ? "; " : "", bench_wait_name[best],
             (long long)e * 2);
    snprintf(m, sizeof m, "bf16 %s %s elements", what, en);
    vsraw.metric = m;
    bench_emit(&vsraw, ours, raw, reps, "%s", note);
  }
  if (c->fail[0]) fprintf(stderr, "bulk: bf16: %s\n", c->fail);
  if (c->rfail[0]) fprintf(stderr, "bulk: bf16: %s\n", c->rfail);
}

int main(void) {
  int quick = bench_quick();
  const size_case *sizes = quick ? QUICK_SIZES : SIZES;
  size_t maxb = sizes[NSIZES - 1].bytes;
  bulk_ctx c = {.fd = -1};
  c.fd = bench_raw_connect(c.rfail, sizeof c.rfail);
  if (c.fd < 0) fprintf(stderr, "bulk: %s\n", c.rfail);
  c.src = xmalloc_touched(maxb);
  c.dst = xmalloc_touched(maxb);
  char why[512] = "";
  c.dev = bench_open(bench_remote_spec(), why, sizeof why);
  if (!c.dev) snprintf(c.fail, sizeof c.fail, "%s", why);

  for (int s = 0; s < NSIZES; s++) {
    const size_case *sc = &sizes[s];
    size_t n = sc->bytes;
    int inner = inner_count(n);
    int64_t shape[1] = {(int64_t)(n / 4)};
    static double t[NVAR][MAX_REPS];
    int reps = 0;
    c.held = NULL;
    if (c.dev && !c.fail[0]) {
      int rc = dispatch_tensor_from_data(c.dev, DISPATCH_F32, 1, shape, c.src,
                                         n, &c.held);
      if (rc == 0) rc = dispatch_device_sync(c.dev);
      if (rc < 0)
        snprintf(c.fail, sizeof c.fail, "upload %s: %s: %s", sc->name,
                 dispatch_err_name(rc), dispatch_device_errmsg(c.dev));
    }
    bench_def up = {"bulk", NULL, "MB/s", 0, "raw socket", 1,
                    n >= (1u << 20) ? BENCH_GOAL_RATIO_GE : BENCH_GOAL_NONE,
                    BULK_GOAL};
    bench_def down = up;
    double start = bench_now();
    /* one warm-up repetition (r = -1) is measured and dropped: it grows
     * the raw server's buffer and the server's storage */
    for (int r = -1; r < sc->reps; r++) {
      if (r >= 0) {
        int best_put, best_get;
        double *pv[3] = {t[V_PUT_BLOCK], t[V_PUT_CLIENT], t[V_PUT_POLL]};
        double *gv[3] = {t[V_GET_BLOCK], t[V_GET_CLIENT], t[V_GET_POLL]};
        best_put = bench_best_variant(pv, 3, reps);
        best_get = bench_best_variant(gv, 3, reps);
        int unsettled = 0;
        if (reps > 0) {
          double ru[MAX_REPS], rd[MAX_REPS], rp[MAX_REPS], rg[MAX_REPS];
          for (int i = 0; i < reps; i++) {
            ru[i] = 1 / t[V_UP][i];
            rd[i] = 1 / t[V_DOWN][i];
            rp[i] = 1 / pv[best_put][i];
            rg[i] = 1 / gv[best_get][i];
          }
          unsettled = bench_unsettled(&up, ru, rp, reps) ||
                      bench_unsettled(&down, rd, rg, reps);
        }
        if (!bench_more(reps, quick ? sc->reps : MIN_REPS, sc->reps,
                        bench_now() - start, sc->budget, unsettled))
          break;
      }
      double tv[NVAR];
      for (int k = 0; k < NVAR; k++) {
        int v = bench_turn(r, k, NVAR);
        tv[v] = (v == V_FRESH && s < NSIZES - 2) ||
                        ((v == V_KEPT || v == V_PUT_PARTS) &&
                         s < NSIZES - 1)
                    ? NAN
                    : run_variant(&c, v, n, inner);
      }
      if (r < 0) continue;
      for (int v = 0; v < NVAR; v++) t[v][reps] = tv[v];
      reps++;
    }
    dispatch_tensor_free(c.held);
    c.held = NULL;
    if (c.fail[0]) fprintf(stderr, "bulk: %s\n", c.fail);
    if (c.rfail[0]) fprintf(stderr, "bulk: %s\n", c.rfail);

    double *pv[3] = {t[V_PUT_BLOCK], t[V_PUT_CLIENT], t[V_PUT_POLL]};
    double *gv[3] = {t[V_GET_BLOCK], t[V_GET_CLIENT], t[V_GET_POLL]};
    int bp = bench_best_variant(pv, 3, reps);
    int bg = bench_best_variant(gv, 3, reps);
    /* the kept row's limit: the better of the whole PUT and the parts */
    double *kv[2] = {pv[bp], t[V_PUT_PARTS]};
    int bk = s == NSIZES - 1 ? bench_best_variant(kv, 2, reps) : 0;
    double put[MAX_REPS], get[MAX_REPS], kput[MAX_REPS];
    for (int v = 0; v < NVAR; v++) to_mbps(t[v], reps, n);
    memcpy(put, pv[bp], sizeof(double) * (size_t)reps);
    memcpy(get, gv[bg], sizeof(double) * (size_t)reps);
    memcpy(kput, kv[bk], sizeof(double) * (size_t)reps);
    char m[96], note[1200], kwhy[96];
    snprintf(note, sizeof note, "%s%s%s%sraw reference: %s wait", c.fail,
             c.fail[0] ? "; " : "", c.rfail, c.rfail[0] ? "; " : "",
             bench_wait_name[bp]);
    snprintf(m, sizeof m, "upload %s", sc->name);
    up.metric = m;
    bench_emit(&up, t[V_UP], put, reps, "%s", note);
    bench_def vs_mem = {"bulk", m, "MB/s", 0, "memcpy", 1, BENCH_GOAL_NONE,
                        0};
    snprintf(m, sizeof m, "upload %s vs memcpy", sc->name);
    bench_emit(&vs_mem, t[V_UP], t[V_MEMCPY], reps, c.fail[0] ? "%s" : NULL,
               c.fail);
    if (s >= NSIZES - 2) {
      bench_def fresh = {"bulk", m, "MB/s", 0, "raw socket", 0,
                         BENCH_GOAL_NONE, 0};
      snprintf(m, sizeof m, "raw socket %s into fresh malloc", sc->name);
      bench_emit(&fresh, t[V_FRESH], put, reps,
                 "diagnostic: receiver allocates per transfer (faults)%s%s",
                 c.rfail[0] ? "; " : "", c.rfail);
    }
    if (s == NSIZES - 1) {
      bench_def kept = {"bulk", m, "MB/s", 0, "raw socket", 1,
                        BENCH_GOAL_RATIO_GE, KEPT_GOAL};
      snprintf(m, sizeof m, "upload %s as %d tensors kept live", sc->name,
               KEPT_PARTS);
      if (bk) snprintf(kwhy, sizeof kwhy, "16 PUTs of the parts, blocking wait");
      else snprintf(kwhy, sizeof kwhy, "one PUT, %s wait", bench_wait_name[bp]);
      snprintf(note, sizeof note, "%s%s%s%sraw reference: %s", c.fail,
               c.fail[0] ? "; " : "", c.rfail, c.rfail[0] ? "; " : "",
               kwhy);
      bench_emit(&kept, t[V_KEPT], kput, reps, "%s", note);
    }
    snprintf(note, sizeof note, "%s%s%s%sraw reference: %s wait", c.fail,
             c.fail[0] ? "; " : "", c.rfail, c.rfail[0] ? "; " : "",
             bench_wait_name[bg]);
    snprintf(m, sizeof m, "download %s", sc->name);
    down.metric = m;
    bench_emit(&down, t[V_DOWN], get, reps, "%s", note);
    snprintf(m, sizeof m, "download %s vs memcpy", sc->name);
    bench_emit(&vs_mem, t[V_DOWN], t[V_MEMCPY], reps, c.fail[0] ? "%s" : NULL,
               c.fail);
  }

  half_rows(&c, quick);

  /* OpenSSL's own cipher speed on one core, the limit of a TLS stream
   * (the client encrypts every byte on one thread), then the large size
   * up and down over tls:// (TLS 1.3 negotiates AES-256-GCM), each
   * repetition pairing the transfers with the cipher, in rotating order */
  size_t n = sizes[NSIZES - 2].bytes;
  int64_t shape[1] = {(int64_t)(n / 4)};
  const char *tls = getenv("DISPATCH_BENCH_TLS");
  char twhy[512] = "";
  dispatch_device *tdev = tls && *tls ? bench_open(tls, twhy, sizeof twhy)
                                      : NULL;
  if (!tls || !*tls)
    snprintf(twhy, sizeof twhy, "no TLS server (DISPATCH_BENCH_TLS)");
  enum { A128, A256, TUP, TDOWN, NT };
  int treps = quick ? 2 : 7;
  double tt[NT][16];
  int k = 0;
  for (int r = -1; r < treps; r++) {
    double tv[NT] = {NAN, NAN, NAN, NAN};
    dispatch_tensor *x = NULL;
    for (int j = 0; j < NT; j++) {
      int v = bench_turn(r, j, NT);
      if (v == A128 || v == A256) {
        tv[v] = aes_gcm_time(v == A128 ? EVP_aes_128_gcm() : EVP_aes_256_gcm(),
                             c.src, c.dst, n);
        continue;
      }
      if (!tdev || twhy[0]) continue;
      int rc = 0;
      double t0 = bench_now();
      if (v == TUP) {
        dispatch_tensor *y = NULL;
        rc = dispatch_tensor_from_data(tdev, DISPATCH_F32, 1, shape, c.src, n,
                                       &y);
        if (rc == 0) rc = dispatch_device_sync(tdev);
        dispatch_tensor_free(y);
      } else {
        if (!x) { /* the tensor to download, put there untimed */
          rc = dispatch_tensor_from_data(tdev, DISPATCH_F32, 1, shape, c.src,
                                         n, &x);
          if (rc == 0) rc = dispatch_device_sync(tdev);
          t0 = bench_now();
        }
        if (rc == 0) rc = dispatch_tensor_read(x, c.dst, n);
        if (rc == 0 && memcmp(c.src, c.dst, n) != 0) {
          snprintf(twhy, sizeof twhy, "tls: bytes read back differ");
          continue;
        }
      }
      tv[v] = bench_now() - t0;
      if (rc < 0) {
        snprintf(twhy, sizeof twhy, "tls: %s: %s", dispatch_err_name(rc),
                 dispatch_device_errmsg(tdev));
        tv[v] = NAN;
      }
    }
    dispatch_tensor_free(x);
    if (r < 0) continue;
    for (int v = 0; v < NT; v++) tt[v][k] = bench_mbps(n, tv[v]);
    k++;
  }
  char m[96];
  bench_def aes = {"bulk", "AES-128-GCM encrypt (EVP; 16 KiB records)",
                   "MB/s", 0, NULL, 0, BENCH_GOAL_NONE, 0};
  bench_emit(&aes, tt[A128], NULL, k,
             "one core's cipher speed: the limit of a TLS stream");
  aes.metric = "AES-256-GCM encrypt (EVP; 16 KiB records)";
  bench_emit(&aes, tt[A256], NULL, k,
             "one core's cipher speed: the limit of a TLS stream");
  bench_def tr = {"bulk", m, "MB/s", 0, "AES-256-GCM one core", 1,
                  BENCH_GOAL_NONE, 0};
  snprintf(m, sizeof m, "TLS upload %s", sizes[NSIZES - 2].name);
  bench_emit(&tr, tt[TUP], tt[A256], k, twhy[0] ? "%s" : NULL, twhy);
  snprintf(m, sizeof m, "TLS download %s", sizes[NSIZES - 2].name);
  bench_emit(&tr, tt[TDOWN], tt[A256], k, twhy[0] ? "%s" : NULL, twhy);
  dispatch_device_close(tdev);

  dispatch_device_close(c.dev);
  free(c.src);
  free(c.dst);
  if (c.fd >= 0) close(c.fd);
  return 0;
}
