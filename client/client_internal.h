/* Internal to libdispatch-client: handle layouts shared by the client/ sources.
 * Internal functions carry the dispatch__ prefix and hidden visibility, so
 * the shared library exports only the public dispatch_* API. */
#ifndef DISPATCH_CLIENT_INTERNAL_H
#define DISPATCH_CLIENT_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "dispatch_backward.h"
#include "dispatch_client.h"
#include "cuda_plugin.h"
#include "dsp.h"

#define DISPATCH__HIDDEN __attribute__((visibility("hidden")))

/* ids queued for one batched Free message */
#define DISPATCH__FREE_BATCH 256
/* An Ops request holds at most this many records and bytes of them: it is
 * sent once full, so a long pipeline of small ops reaches the server in
 * pieces it starts on while the rest is being queued */
#define DISPATCH__OPS_MAX 256
/* the first batch after a wait, doubling up to DISPATCH__OPS_MAX */
#define DISPATCH__OPS_FIRST 16
#define DISPATCH__OPS_BYTES 16384

struct dispatch__scope {
  struct dispatch__scope *parent;
  dispatch_tensor *head; /* tensors whose scope reference this scope holds */
};

struct dispatch_tensor {
  long refcount;
  dispatch_tensor_kind kind;
  dispatch_device *dev;
  dsp_meta meta;
  int64_t numel;
  dsp_tensor *local;      /* LOCAL: one reference */
  uint64_t id;            /* REMOTE: the client-chosen id on the server */
  dispatch_tensor *inner; /* AUTODIFF: one reference */
  int tracked;            /* LOCAL/REMOTE: wrapped by an AUTODIFF already */
  int status;             /* 0 or the error that poisoned it */
  char *poison_msg;       /* that error's message (NULL: none kept) */
  struct dispatch__scope *scope; /* the scope holding one reference */
  dispatch_tensor *sprev, *snext; /* scope list */
  dispatch_tensor *aprev, *anext; /* device's list of live tensors */
  uint32_t gslot; /* LOCAL/REMOTE: 1 + its slot in the device's open
                     capture (graph.c), 0 when none */
  int made_by; /* LOCAL/REMOTE: 1 + the op whose AUTODIFF output wraps it
                  (a non-leaf: it gets no gradient), 0 when none */
};

struct dispatch_grads {
  dispatch_device *dev;
  dsp_grads *local; /* LOCAL */
  uint64_t id;      /* REMOTE container id */
  dispatch_grads *prev, *next;
  uint32_t gslot; /* as a tensor's: its slot in the open capture */
};

struct dispatch_optim {
  dispatch_device *dev;
  dsp_opcode op; /* DSP_OP_SGD_STEP, DSP_OP_ADAM_STEP or DSP_OP_ADAMW_STEP */
  int n;
  int k; /* state tensors per parameter */
  dispatch_tensor **params; /* AUTODIFF, one reference each */
  dispatch_tensor **states; /* n*k plain tensors, one reference each */
  double floats[DSP_MAX_ATTR_FLOATS];
  int n_floats;
  int64_t t; /* Adam step count */
  double *wd;      /* AdamW: n weight decays (NULL: none, all 0) */
  double max_norm; /* > 0: clip by global norm (dispatch_optim_set_clip) */
  /* an f64 scalar on the device that each clipped step overwrites with
   * its global norm (made by the first dispatch_optim_set_clip > 0) */
  dispatch_tensor *norm;
  /* set by dispatch_group_step for the one step it sends (group.c): the
   * gradients are all-reduced through the group first; group 0: none */
  uint64_t group, group_seq;
  int group_reduce;
  /* dynamic loss scaling (dispatch_optim_set_loss_scale), NULL when off:
   * the scale (f32, shape []) and its counts (i64 [2]) on the device */
  dispatch_tensor *ls_scale, *ls_counts;
  double ls_growth, ls_backoff;
  int64_t ls_interval;
  dispatch_optim *prev, *next;
};

/* The wire side of a REMOTE device. */
/* The spin policy of a connection's waits (wait.c): where the server is,
 * fixed at connect, and what recent replies took. */
#define DISPATCH__SPIN_MIN_CPUS 3          /* loopback needs this many */
#define DISPATCH__SPIN_MIN_NS 5000         /* 5 us */
#define DISPATCH__SPIN_MAX_NS 100000       /* 100 us */
/* loopback with fewer than DISPATCH__SPIN_MIN_CPUS cores: long enough for a
 * reply the server's network thread makes alone (a Sync, a Read, an inline
 * op: ~6 us here), short against a worker's wake-up */
#define DISPATCH__SPIN_SHARED_MAX_NS 50000 /* 50 us */
#define DISPATCH__SPIN_SLACK_NS 5000       /* on top of twice the estimate */
#define DISPATCH__SPIN_SKIP_MAX 63         /* waits that sleep at once */
typedef struct dispatch__spin {
  int64_t override_ns; /* DISPATCH_SPIN_US in ns, -1: not set */
  int ncpu;            /* cores this process may run on */
  int loopback;        /* the server's address is loopback */
  int64_t est_ns;      /* running estimate of a reply's latency, 0: none */
  uint32_t fails;      /* spins in a row that ended without the reply */
  uint32_t skip;       /* waits left that sleep without spinning */
} dispatch__spin;

/* Fills s for a connected socket fd: DISPATCH_SPIN_US, the cores this
 * process may use, whether fd's peer is loopback; no history. */
DISPATCH__HIDDEN void dispatch__spin_init(dispatch__spin *s, int fd);
/* How long the next wait polls before it sleeps, in ns (0: sleep at
 * once). A pure function of s. */
DISPATCH__HIDDEN int64_t dispatch__spin_budget(const dispatch__spin *s);
/* Records one wait for a reply that was given budget_ns of spin and saw
 * the socket readable after waited_ns. */
DISPATCH__HIDDEN void dispatch__spin_record(dispatch__spin *s,
                                            int64_t budget_ns,
                                            int64_t waited_ns);

typedef struct dispatch__conn {
  int fd;
  int dead;        /* connection lost: every later call gives dead_code */
  int dead_code;   /* DISPATCH_ECONN; DISPATCH_ESHUTDOWN when the server
                      said it was going away; ESESSION or EAUTH when a
                      resume was refused */
  char dead_why[192];
  int ready; /* hello answered: the server accepts other requests */
  int timeout_ms;
  uint64_t next_id; /* tensor ids, container ids and request ids */
  uint8_t *buf;     /* frames queued but not sent */
  size_t len, cap;
  uint64_t free_ids[DISPATCH__FREE_BATCH];
  int n_free_ids;
  uint64_t free_grads[DISPATCH__FREE_BATCH];
  int n_free_grads;
  uint64_t max_frame;
  const struct dispatch__transport *tr; /* tcp:// or tls:// (conn.h) */
  struct ssl_st *ssl;         /* tls://: the session (NULL: plain TCP) */
  struct ssl_ctx_st *ssl_ctx;
  int tls_failed;             /* a TLS-level failure (not the socket) */
  int tls_expired;            /* the last TLS wait ran out of time */
  uint8_t *rbuf; /* plain TCP: received bytes not consumed yet (NULL on
                    TLS: OpenSSL buffers records itself) */
  size_t rpos, rlen;
  int refs; /* the device and its peers (dispatch_device_open_peer) */
  /* the in-use guard (device.c, dispatch__enter): the thread inside a
   * public call on the device or a peer, and how deeply it nests */
  _Atomic(uintptr_t) owner;
  unsigned depth;
  char *server_device; /* the hello's session device: "cpu:0" */
  /* session resume (replay.c): every request gets a seq and stays in the
   * replay log until a later waiting reply shows the server has it; after
   * a dropped connection the library reconnects, presents the token and
   * sends again what the server did not receive */
  int resume_off;       /* option no_resume / env DISPATCH_RESUME=0 */
  int resume_ms;        /* total bound on reconnecting; 0: the default */
  int resumable;        /* the server gave a token and resume is on */
  int broken;           /* the socket is gone, a reconnect is due */
  int resuming;         /* inside the reconnect: no nesting */
  int closing;          /* the device is closing: no reconnect */
  uint8_t token[64];    /* the resume token: a secret, never printed */
  size_t token_len;
  unsigned grace_s;     /* the server's --session-grace */
  uint64_t seq;         /* last seq handed out */
  uint64_t acked;       /* seq of the last waiting reply received */
  uint8_t *log;         /* frames sent or queued, not yet acknowledged */
  size_t log_len, log_cap;
  uint64_t *log_seq;    /* each logged frame's seq and offset */
  size_t *log_off;
  size_t n_log, log_slots;
  unsigned resumes;     /* successful resumes on this connection */
  /* a large upload's bytes are not copied into the log: the caller's
   * buffer stands in for them until the Sync that queue() sends before
   * returning shows the server has them */
  const void *ext_bulk;
  size_t ext_len;
  size_t ext_at;        /* log offset where they belong */
  uint64_t ext_seq;
  int stash_code;       /* a deferred error that Sync brought back, */
  char stash_msg[512];  /* reported at the next wait */
  char *host, *port, *auth, *name; /* what the reconnect needs again */
  dispatch_options *tls_o; /* tls://: copies of the TLS options */
  dispatch__spin spin;  /* plain TCP waits (wait.c) */
  /* 1.3: ops queued as packed records (common/op_record.h), sent as one
   * Ops request when the batch is full or anything else is sent */
  int batch_ops;        /* the server speaks 1.3 and DISPATCH_OPS_BATCH is
                           not 0 */
  uint8_t *ops;         /* the open batch's records (DISPATCH__OPS_BYTES) */
  size_t ops_len;
  int ops_n;
  int ops_limit;        /* records that close the open batch */
  uint32_t server_minor; /* the hello's: what the server understands */
  int server_checkpoints; /* the hello's (1.6): it has --checkpoint-dir */
  /* 1.4 keepalive (call.c, conn.c): while the server works on the session's
   * requests it sends a keepalive every ka_ms when it writes nothing else,
   * so a wait tells a busy server (DISPATCH_ETIMEDOUT at its deadline, the
   * session intact) from a silent one (no bytes for timeout_ms: the
   * connection is lost, and resumed). ka_ms 0: an older server, whose
   * waits end at the timeout with DISPATCH_ECONN as before. */
  uint32_t ka_ms;       /* the interval the server said it uses */
  uint32_t ka_asked;    /* the interval last asked of it */
  int64_t heard_ms;     /* when bytes last came, or the current wait began */
  /* a waiting request whose wait timed out: its reply is still to come,
   * and the next wait takes it first (pend_id 0: none) */
  uint64_t pend_id, pend_seq;
  int pend_case;        /* its Request body case */
  uint64_t pend_key;    /* a Read's tensor, a replay's graph */
  uint64_t pend_hash;   /* a replay's input bytes (FNV-1a) */
  size_t pend_len;      /* their length */
  size_t pend_dst_len;  /* the reply bulk its caller expected */
  uint64_t pend_next;   /* next_id after it: unchanged, nothing went since */
} dispatch__conn;

/* The keepalive interval a wait bound of timeout_ms asks for (a quarter
 * of it; 0: none, for no bound). */
DISPATCH__HIDDEN uint32_t dispatch__keepalive_for(int timeout_ms);
/* What a wait does at now (ms) on a connection whose server sends
 * keepalives: DISPATCH__WAIT_ON (poll on, at most *left ms),
 * DISPATCH__WAIT_SILENT (nothing heard for timeout_ms: the connection is
 * lost) or DISPATCH__WAIT_TIMEDOUT (the wait's deadline passed with the
 * server alive; only where a reply may begin: at_boundary). timeout_ms 0:
 * no bound. A pure function, unit-tested (tests/test_client_wait.c). */
enum { DISPATCH__WAIT_ON, DISPATCH__WAIT_SILENT, DISPATCH__WAIT_TIMEDOUT };
DISPATCH__HIDDEN int dispatch__wait_verdict(int64_t now, int64_t heard,
                                            int64_t deadline, int timeout_ms,
                                            int at_boundary, int64_t *left);

/* What a device does by kind: one row per kind (LOCAL: local.c, REMOTE:
 * remote.c) that the device points to, so the code around a call (the
 * guard, argument checks, scopes, the capture hooks, sync mode, error
 * recording) is written once and never asks which kind it has. A "plain"
 * tensor is LOCAL or REMOTE (the one an AUTODIFF wraps). Entries return 0
 * or a negative code with the detail in the device's ctx; the caller
 * records it (dispatch__ret). Tensors an entry makes are unscoped; the
 * caller waits in sync mode (dispatch__sync_call), then adopts them. */
typedef struct dispatch__open_args {
  const char *host, *port, *token, *client_name;
  const char *device;           /* REMOTE: after "HOST:PORT/", or NULL */
  const dispatch_options *tls;  /* tls://: the TLS options, else NULL */
} dispatch__open_args;
typedef struct dispatch__kind_ops {
  dispatch_tensor_kind kind;
  /* device open: LOCAL its storage cache, REMOTE the connection; on
   * failure the caller runs close */
  int (*open)(dispatch_device *dev, const dispatch__open_args *a);
  /* device close, first: a device going while its session stays (a peer)
   * frees what it made there */
  void (*detach)(dispatch_device *dev);
  /* device close, after its graphs: the connection (or its share) goes */
  void (*close)(dispatch_device *dev);
  /* 0 when dev's session can open a peer device, else why not */
  int (*peer)(dispatch_device *dev);
  /* op on the plain inputs cin (checked, of dev) into a new plain *out;
   * *wrap: the output is tracked (gets an AUTODIFF wrapper) */
  int (*op)(dispatch_device *dev, dsp_opcode op, dispatch_tensor *const *cin,
            int n_in, const dsp_attrs *a, int any_ad, dispatch_tensor **out,
            int *wrap);
  /* a new plain tensor holding a copy of data (checked) */
  int (*upload)(dispatch_device *dev, const dsp_meta *m, const void *data,
                size_t nbytes, dispatch_tensor **out);
  /* the bytes of plain t into buf (nbytes checked) */
  int (*read)(dispatch_tensor *t, void *buf, size_t nbytes);
  /* a copy of plain t on dev (of this kind) without its bytes passing
   * through the client; 1: not possible, copy the bytes */
  int (*move)(dispatch_tensor *t, dispatch_device *dev, dispatch_tensor **out);
  /* a handle's last reference is going (REMOTE: its id is freed) */
  void (*release)(dispatch_tensor *t);
  /* a handle is freed (LOCAL: its tensor and counters) */
  void (*destroy)(dispatch_tensor *t);
  int (*track)(dispatch_tensor *t);
  /* backward from the plain loss into g (linked by the caller) */
  int (*backward)(dispatch_tensor *loss, int retain, dispatch_grads *g);
  /* the gradient of the tracked plain leaf as a new plain *out */
  int (*grad)(dispatch_grads *g, dispatch_tensor *leaf, dispatch_tensor **out);
  void (*grads_free)(dispatch_grads *g);
  int (*step)(dispatch_optim *opt, dispatch_grads *g, const dsp_attrs *a);
  /* graph end: makes the built graph runnable (REMOTE: defines it) */
  int (*graph_define)(dispatch_graph *g);
  /* a replay with the inputs and outputs checked (graph.c check_io) */
  int (*graph_replay)(dispatch_graph *g, const dispatch_graph_io *in,
                      const dispatch_graph_io *out);
  /* graph id of dev is freed */
  void (*graph_free)(dispatch_device *dev, uint64_t id);
  /* waits until everything sent has run; the session's deferred error */
  int (*sync)(dispatch_device *dev);
  int (*stats)(dispatch_device *dev, dispatch_stats *all);
  int (*devices)(dispatch_device *dev, dispatch_device_info *all, int max,
                 int *n);
  int (*set_cache)(dispatch_device *dev, uint64_t bytes);
} dispatch__kind_ops;
DISPATCH__HIDDEN extern const dispatch__kind_ops dispatch__local_ops;
DISPATCH__HIDDEN extern const dispatch__kind_ops dispatch__remote_ops;

struct dispatch_device {
  const dispatch__kind_ops *ops; /* its kind's row: LOCAL or REMOTE */
  char *spec;
  dsp_ctx *ctx; /* detail messages; LOCAL: runs the ops */
  /* local:cuda:N: the plugin and the device the ctx runs on (closed
   * after the ctx); NULL otherwise */
  const dsp_cuda_plugin *cuda;
  dsp_backend *cuda_be;
  int errcode;
  struct dispatch__scope *scope;
  /* the first error since open or dispatch_device_clear_error: a call
   * given a NULL input answers with it (dispatch_device_error) */
  int first_code;
  char first_msg[512];
  uint64_t serial; /* names the device in a thread's record of it */
  dispatch_tensor *all;
  dispatch_grads *grads;
  dispatch_optim *optims;
  dispatch_stats local_stats; /* LOCAL counters */
  dispatch__conn *conn; /* shared with peers (one session); every device
                           has one (LOCAL: only its timeout is used) */
  char *device; /* REMOTE: the server device its uploads and creation ops
                   land on, NULL: the session's (hello) device */
  int closing;
  struct dispatch__capture *capture; /* graph being captured (graph.c) */
  dispatch_graph *graphs;            /* live graphs of the device */
  int sync; /* REMOTE: every call that sends a request waits for the
               server (option sync, env DISPATCH_SYNC=1) */
  int autocast; /* dispatch_autocast's dtype: DSP_F32 (0) off, or the
                   half dtype matmuls and the like run in */
};

/* The in-use guard: every public call that can fail enters it first, so
 * a second thread calling into a device (or a peer of it) while a call is
 * in flight gets DISPATCH_EBUSY at once and touches nothing. Nested calls
 * of the owning thread pass. dispatch__leave runs at the caller's scope
 * end (cleanup attribute), so every return releases it. */
typedef struct dispatch__hold {
  dispatch__conn *c; /* NULL: nothing held */
} dispatch__hold;
/* 0 and *h held (dev NULL: nothing to hold), or DISPATCH_EBUSY naming fn
 * and dev, recorded for this thread only (dispatch_device_errmsg on it). */
DISPATCH__HIDDEN int dispatch__enter(dispatch_device *dev, const char *fn,
                                     dispatch__hold *h);
DISPATCH__HIDDEN void dispatch__leave(dispatch__hold *h);
#define DISPATCH__GUARD(dev, fn)                                            \
  dispatch__hold dispatch__hold_                                            \
      __attribute__((cleanup(dispatch__leave))) = {NULL};                   \
  if (dispatch__enter((dev), (fn), &dispatch__hold_) < 0) return DISPATCH_EBUSY
/* Sync mode: after a call on dev queued a request, waits for the server
 * (a Sync) and returns the error it brings back, which is that call's
 * (nothing else is pending in sync mode); 0 when sync mode is off or dev
 * is LOCAL. The caller records the code (dispatch__ret). */
DISPATCH__HIDDEN int dispatch__sync_call(dispatch_device *dev);

/* Records rc as the device's last error (if negative), and as its first
 * when none is kept, with the message in dev->ctx; returns rc. */
DISPATCH__HIDDEN int dispatch__ret(dispatch_device *dev, int rc);
/* The answer to a call given a NULL input (index i of fn): the first error
 * of dev, else (dev NULL) of the device that last failed on this thread,
 * else DISPATCH_EINVAL "fn: input i is NULL". */
DISPATCH__HIDDEN int dispatch__null_input(dispatch_device *dev,
                                          const char *fn, int i);
/* The answer to a call given t, which the client knows is poisoned: the
 * error that poisoned it, with its message, recorded on dev. */
DISPATCH__HIDDEN int dispatch__poisoned_input(dispatch_device *dev,
                                              const dispatch_tensor *t);
/* Drops one reference held by library code (never the one a scope holds
 * for the caller); at zero the tensor is freed as by dispatch_tensor_free. */
DISPATCH__HIDDEN void dispatch__tensor_unref(dispatch_tensor *t);

/* A new handle of kind on dev with one reference; registered in the
 * device's list and, if scoped, in its innermost scope. */
DISPATCH__HIDDEN int dispatch__tensor_new(dispatch_device *dev,
                                          dispatch_tensor_kind kind,
                                          const dsp_meta *m, int scoped,
                                          dispatch_tensor **out);
/* Registers t in the innermost scope of its device (if any). */
DISPATCH__HIDDEN void dispatch__scope_adopt(dispatch_tensor *t);
/* Removes t from its scope's list (its last reference is going). */
DISPATCH__HIDDEN void dispatch__scope_forget(dispatch_tensor *t);
/* Frees a handle's resources without touching refcounts (device close). */
DISPATCH__HIDDEN void dispatch__tensor_destroy(dispatch_tensor *t);

/* The generic op runner every public op goes through. dev is used only
 * for ops without inputs (creation). scoped: register the output in the
 * innermost scope. */
DISPATCH__HIDDEN int dispatch__run(dispatch_device *dev, dsp_opcode op,
                                   dispatch_tensor *const *in, int n_in,
                                   const dsp_attrs *a, int scoped,
                                   dispatch_tensor **out);

/* 0 when the server has dev->device, else DISPATCH_EDEVICE naming the
 * devices it has (one Stats round trip). */
DISPATCH__HIDDEN int dispatch__remote_check_device(dispatch_device *dev);

/* Ids for tensors, gradient containers, graphs and requests, from the
 * device's connection (call.c). */
DISPATCH__HIDDEN uint64_t dispatch__remote_new_id(dispatch_device *dev);
/* Frees never fail towards the caller: the id is queued and batched
 * (call.c). */
DISPATCH__HIDDEN void dispatch__remote_free(dispatch_device *dev, uint64_t id,
                                            int is_grads);
/* One Sync round trip: the session's deferred error, if any (remote.c). */
DISPATCH__HIDDEN int dispatch__remote_sync(dispatch_device *dev);
/* remote.c, protocol 1.6: the server writes tensors ids[i] under names[i]
 * (and the metadata pairs) into file of its --checkpoint-dir (one round
 * trip); or reads file into new tensors *first, *first + 1, ... of the
 * session, whose names, metas and metadata fill *f (the caller's,
 * dsp_st_file_release; the ids are the caller's to give handles or
 * free). 0, or the server's code with its message in dev->ctx. */
struct dsp_st_file;
DISPATCH__HIDDEN int dispatch__remote_ckpt_save(
    dispatch_device *dev, const char *file, const char *const *names,
    const uint64_t *ids, int n, const char *const *keys,
    const char *const *vals, int n_meta);
DISPATCH__HIDDEN int dispatch__remote_ckpt_load(dispatch_device *dev,
                                                const char *file,
                                                uint64_t *first,
                                                struct dsp_st_file *f);

/* graph.c: capture hooks. Each records what its caller just did on a
 * device with an open capture (callers test dev->capture first); they
 * cannot fail towards the caller: a failure marks the capture broken and
 * dispatch_graph_end reports it. */
DISPATCH__HIDDEN void dispatch__graph_op(dispatch_device *dev, dsp_opcode op,
                                         dispatch_tensor *const *in, int n_in,
                                         const dsp_attrs *a, int no_grad,
                                         dispatch_tensor *out);
DISPATCH__HIDDEN void dispatch__graph_input(dispatch_tensor *t);
DISPATCH__HIDDEN void dispatch__graph_track(dispatch_tensor *t);
DISPATCH__HIDDEN void dispatch__graph_backward(dispatch_tensor *loss,
                                               int retain,
                                               dispatch_grads *g);
DISPATCH__HIDDEN void dispatch__graph_grad(dispatch_grads *g,
                                           dispatch_tensor *leaf,
                                           dispatch_tensor *out);
/* Autocast (autocast.c): casts the inputs of op that dev's policy
 * changes, each into casts[i] (a new unscoped tensor, which the caller
 * releases after the op ran) with cin[i] set to its inner tensor; inputs
 * it keeps are left alone (casts[i] stays NULL). 0, or a cast's error. */
DISPATCH__HIDDEN int dispatch__autocast_inputs(dispatch_device *dev,
                                               dsp_opcode op,
                                               dispatch_tensor *const *in,
                                               int n_in, dispatch_tensor **cin,
                                               dispatch_tensor **casts);
DISPATCH__HIDDEN void dispatch__graph_step(dispatch_optim *opt,
                                           dispatch_grads *g,
                                           const dsp_attrs *a);
/* t's (or g's) last reference is going: recorded as a release */
DISPATCH__HIDDEN void dispatch__graph_forget(dispatch_tensor *t);
DISPATCH__HIDDEN void dispatch__graph_forget_grads(dispatch_grads *g);
/* Device close: the capture and every graph of dev go. */
DISPATCH__HIDDEN void dispatch__graph_close_all(dispatch_device *dev);
/* The graph rows of the two kinds (they need the graph's layout, which
 * graph.c keeps): a replay in process, and the GraphDefine and
 * GraphReplay requests. */
DISPATCH__HIDDEN int dispatch__graph_replay_local(
    dispatch_graph *g, const dispatch_graph_io *in,
    const dispatch_graph_io *out);
DISPATCH__HIDDEN int dispatch__graph_define_remote(dispatch_graph *g);
DISPATCH__HIDDEN int dispatch__graph_replay_remote(
    dispatch_graph *g, const dispatch_graph_io *in,
    const dispatch_graph_io *out);

/* call.c: sends req with bulk (queued requests and frees first), waits
 * for its reply; a READ or GRAPH reply's bulk lands in dst when its size
 * is dst_len. *reply as for the other waits: free it with
 * dispatch__remote_reply_free. */
struct Dspwire__Request;
struct Dspwire__Reply;
DISPATCH__HIDDEN int dispatch__remote_call(dispatch_device *dev,
                                           struct Dspwire__Request *req,
                                           const void *bulk, size_t bulk_len,
                                           void *dst, size_t dst_len,
                                           struct Dspwire__Reply **reply);
DISPATCH__HIDDEN void dispatch__remote_reply_free(struct Dspwire__Reply *r);
/* Queues a request that gets no reply (ECONN once the connection is lost). */
DISPATCH__HIDDEN int dispatch__remote_queue(dispatch_device *dev,
                                            struct Dspwire__Request *req);

#endif
