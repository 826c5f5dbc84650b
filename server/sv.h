/* dispatch-server internals shared by the server/ files.
 *
 * Threads: the libuv loop thread does all socket I/O, framing, protobuf
 * decoding and structural validation; worker threads (pool.c) run decoded
 * requests (session.c) in order within a session, one worker per session at
 * a time. A session's tensor table, ctx and tape are touched only by the
 * worker running it; the loop only touches a session's FIFO (under the pool
 * mutex) and its atomic byte counters. */
#ifndef SV_H
#define SV_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "dispatch.pb-c.h"
#include "dsp.h"

/* Debug builds (-DDSP_DEBUG=1: the Makefile's DSP_DEBUG=1, on in make
 * sanitize) check the thread and idle rules above where connections and
 * sessions are made, handed between the loop and the workers, and freed
 * (net.c, pool.c): a broken rule is a bug of the server, reported on
 * stderr with the rule and its place, then abort(). Release builds compile
 * the checks out (cond is not evaluated), so no input can make them
 * abort. msg states the rule. */
#if defined(DSP_DEBUG) && DSP_DEBUG
#define SV_DEBUG_CHECK(cond, msg) \
  ((cond) ? (void)0 : sv__debug_fail(__FILE__, __LINE__, #cond, (msg)))
#else
/* (0 && cond): never evaluated, yet a use of what it names, so a helper
 * only the checks call is not an unused function (clang's
 * -Wunneeded-internal-declaration flags one used only under sizeof) */
#define SV_DEBUG_CHECK(cond, msg) ((void)(0 && (cond)), (void)(msg))
#endif
void sv__debug_fail(const char *file, int line, const char *cond,
                    const char *msg) __attribute__((noreturn));

/* ------------------------------------------------------------ config */

#define SV_MAX_DEVICES 16
#define SV_MAX_PEERS 64

typedef struct sv_config {
  char host[256];              /* --listen's host as given, for messages */
  int port;
  struct sockaddr_storage listen_addr; /* what --listen's host resolved to
                                          first (the one bound) */
  uint64_t max_frame;          /* msg_len + bulk_len of one frame */
  uint64_t max_msg;            /* protobuf part alone */
  uint64_t max_session_bytes;  /* bytes a session makes the server hold:
                                  tensors (named, on the tape, gradients),
                                  scratch, ids, decoded requests */
  uint64_t max_memory;         /* all sessions' budgets and queues together */
  uint64_t max_queued_bytes;   /* decoded requests one session has queued */
  uint64_t max_elements;       /* elements of one tensor */
  uint64_t max_output_queue;   /* unsent reply bytes before a client drops */
  uint32_t max_queued;         /* decoded requests waiting per session */
  uint64_t storage_cache;      /* freed tensor storage kept for reuse */
  uint64_t session_cache;      /* each session's free lists (charged) */
  uint64_t max_op_cost;        /* dsp_op_cost of one op, 0: no limit */
  uint64_t max_replay_cost;    /* dsp_ctx_work of one graph replay, 0: no
                                  limit (--max-replay-cost) */
  uint64_t inline_cost;        /* --inline-cost: an idle session's op of at
                                  most this dsp_op_cost runs on the loop
                                  thread (inline.c); 0: never */
  uint32_t loop_spin_us;       /* --loop-spin-us (net.c loop_spin) */
  int max_sessions;
  int idle_timeout_s;          /* 0: never; counts from the last complete
                                  request */
  int frame_timeout_s;         /* one frame, first byte to last; 0: never */
  int threads;
  int log_level;
  /* TLS and authentication (paths point into argv; NULL when unset) */
  const char *tls_cert;
  const char *tls_key;
  const char *tls_client_ca; /* set: mutual TLS, a client certificate is
                                required and verified against this CA */
  char *token;               /* from --token-file (dsp_malloc), NULL: none;
                                the server copies it (SIGHUP replaces its
                                copy, reload.c) */
  size_t token_len;
  const char *token_file;    /* --token-file's path, reread on SIGHUP */
  int handshake_timeout_s;   /* TLS handshake + hello, 0: never */
  int drain_timeout_s;       /* SIGTERM: how long received work may still
                                run before it is cancelled; 0: none */
  int session_grace_s;       /* a dropped session waits this long for a
                                resume; 0: freed at once, no token */
  /* --device, repeatable (points into argv): "cpu", "cpu:1", "cuda:0",
   * "all"; none given: "cpu" */
  const char *devices[SV_MAX_DEVICES];
  int n_devices;
  uint64_t device_memory;    /* each device's own budget; 0: none beyond
                                --max-memory (still counted per device) */
  int insecure;              /* allow a non-loopback bind without TLS+token
                                (--listen only) */
  /* --metrics-listen: the Prometheus endpoint (metrics.c); off when
   * metrics_host is empty */
  char metrics_host[256];
  int metrics_port;
  struct sockaddr_storage metrics_addr; /* resolved, as listen_addr */
  int metrics_public;        /* --metrics-public: a non-loopback
                                --metrics-listen is allowed */
  char *metrics_token;       /* --metrics-token-file's contents (dsp_malloc),
                                NULL: /metrics needs no token */
  size_t metrics_token_len;
  const char *metrics_token_file; /* its path, reread on SIGHUP */
  int log_format;            /* SV_LOG_TEXT or SV_LOG_JSON */
  /* --checkpoint-dir (points into argv; NULL: off) and the directory
   * opened by sv_config_parse (-1: none), closed by sv_config_release */
  const char *checkpoint_dir;
  int checkpoint_fd;
  /* server-to-server transfers (peer.c; strings point into argv) */
  const char *name;          /* --name: what peers call this server; NULL:
                                it grants no transfers */
  const char *peers[SV_MAX_PEERS]; /* --peer NAME=ADDR, repeatable */
  int n_peers;
  char *peer_token;          /* --peer-token-file's contents (dsp_malloc),
                                sent in the hello to a peer; NULL: none */
  size_t peer_token_len;
  const char *peer_token_file;
  const char *peer_ca;       /* set: TLS to peers, verified against it */
  const char *peer_cert;     /* mutual TLS: this server's client cert */
  const char *peer_key;
  int peer_cap_ttl_s;        /* a capability's life (--peer-cap-ttl) */
  int peer_timeout_s;        /* connect and each wait of a pull */
  /* --mpi: one rank of an MPI group (group.c); --mpi-timeout, and
   * --mpi-insecure (ranks beyond this host's loopback allowed) */
  int mpi;
  int mpi_timeout_s;
  int mpi_insecure;
} sv_config;

/* Fills the documented defaults. */
void sv_config_defaults(sv_config *c);
/* Parses argv into c; returns 0, 1 for --help (usage printed to stdout), or
 * -1 with a message on stderr. */
int sv_config_parse(sv_config *c, int argc, char **argv);
/* Frees what parsing allocated (the tokens). */
void sv_config_release(sv_config *c);
/* Reads a token file (--token-file, --metrics-token-file): its contents
 * less one trailing newline (and a CR before it), at most 4096 bytes, not
 * empty. 0 with *out (dsp_malloc'd, NUL-terminated; the caller gives it
 * back with sv_secret_free) and *out_len; -1 with nothing allocated and
 * the reason, starting with path, in why[0..len-1]. */
int sv_secret_read(const char *path, char **out, size_t *out_len, char *why,
                   size_t len);
/* Wipes and frees *s (NULL is fine) and sets *s = NULL, *len = 0. */
void sv_secret_free(char **s, size_t *len);
/* 1 when got (NUL-terminated, NULL: none sent) equals want (want_len
 * bytes), in time that does not depend on where they differ (hello.c). */
int sv_token_matches(const char *want, size_t want_len, const char *got);
/* 1 when sa is a loopback address: 127.0.0.0/8, ::1 or ::ffff:127.x.
 * Names are judged by what they resolve to (sv_config_parse resolves
 * --listen and requires every address to pass for a plain bind). */
int sv_addr_is_loopback(const struct sockaddr *sa);

/* Runs the server until SIGINT/SIGTERM; returns 0 after a clean shutdown,
 * or a negative DISPATCH_E* code when it could not start. */
int sv_run(const sv_config *c);
/* Set by sv_run when it has already written the reason it could not start
 * to stderr as one line (a device that cannot be opened). */
extern int sv_start_reason_printed;

/* ------------------------------------------------------------ logging */

enum { SV_LOG_ERROR = 0, SV_LOG_WARN = 1, SV_LOG_INFO = 2, SV_LOG_DEBUG = 3 };
/* --log-format: "TIME dispatch-server LEVEL: MSG" lines, or one JSON
 * object a line ({"ts", "level", "msg", and "session"/"peer" when the line
 * is about a connection}); TIME is ISO-8601 UTC with milliseconds. */
enum { SV_LOG_TEXT = 0, SV_LOG_JSON = 1 };
extern int sv_log_level;
extern int sv_log_format;
int sv_log_parse_level(const char *s); /* -1 when unknown */
int sv_log_parse_format(const char *s); /* -1 when unknown */
void sv_log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* A line about one connection: session is its id (the number in "conn N"),
 * peer its address or NULL. Text: "conn N (PEER): MSG"; JSON: the two as
 * fields of their own. */
void sv_log_conn(int level, unsigned long long session, const char *peer,
                 const char *fmt, ...) __attribute__((format(printf, 4, 5)));
#define SV_LOG_ON(l) ((l) <= sv_log_level)
/* A client-supplied string made safe to quote in a log line: at most max
 * characters, control bytes, backslashes and invalid UTF-8 as \xNN, "..."
 * when cut; written to buf (len bytes), which is returned. */
#define SV_LOG_STR_MAX 64
const char *sv_log_str(char *buf, size_t len, const char *s, size_t max);

/* ------------------------------------------------------------ id map */

/* u64 -> pointer, open addressing with backward-shift deletion. Ids come
 * from the network: any value (including 0 and UINT64_MAX) is a valid
 * key. */
typedef struct sv_idmap {
  uint64_t *keys;
  void **vals; /* NULL marks an empty slot: values are never NULL */
  size_t cap;  /* 0 or a power of two */
  size_t count;
} sv_idmap;

void sv_idmap_init(sv_idmap *m);
void sv_idmap_clear(sv_idmap *m); /* frees the table, not the values */
void *sv_idmap_get(const sv_idmap *m, uint64_t key);
/* Inserts a key that is not present; DISPATCH_ENOMEM leaves m unchanged. */
int sv_idmap_put(sv_idmap *m, uint64_t key, void *val);
/* Removes key and returns its value (NULL when absent). */
void *sv_idmap_del(sv_idmap *m, uint64_t key);
/* Iteration: slots 0..cap-1 whose vals[i] != NULL. */

/* ------------------------------------------------------------ counters */

/* Which limit refused something, for dispatch_limit_violations_total
 * (metrics.c names them). */
typedef enum sv_limit {
  SV_LIM_QUOTA,             /* a memory budget: session, queue, server,
                               device */
  SV_LIM_MAX_ELEMENTS,      /* --max-elements */
  SV_LIM_MAX_OP_COST,       /* --max-op-cost */
  SV_LIM_FRAME_SIZE,        /* --max-frame, the protobuf cap, pre-hello */
  SV_LIM_MAX_SESSIONS,      /* --max-sessions */
  SV_LIM_OUTPUT_QUEUE,      /* --max-output-queue */
  SV_LIM_IDLE_TIMEOUT,      /* --idle-timeout (idle, or not reading) */
  SV_LIM_HANDSHAKE_TIMEOUT, /* --handshake-timeout */
  SV_LIM_FRAME_TIMEOUT,     /* --frame-timeout */
  SV_LIM_COUNT
} sv_limit;

#define SV_METRIC_OPS 128 /* op codes are below this (dsp.h) */
#define SV_METRIC_ERRS 64 /* -code of every DISPATCH_E* is below this */

/* Counters any thread bumps (relaxed atomics; the metrics thread reads
 * them without a lock). Index 0 of errors collects codes out of range. */
typedef struct sv_counters {
  atomic_llong ops[SV_METRIC_OPS];
  atomic_llong errors[SV_METRIC_ERRS];
  atomic_llong limits[SV_LIM_COUNT];
  atomic_llong dev_tensors[SV_MAX_DEVICES]; /* by index in devices */
  atomic_llong dev_bytes[SV_MAX_DEVICES];
  /* detached sessions expired to make room for a new session (resume.c):
   * [0] the server had closed their connection for a limit, [1] the
   * oldest of those a client dropped */
  atomic_llong evicted[2];
  /* SIGHUP reloads (reload.c): [0] every file taken, [1] one refused */
  atomic_llong reloads[2];
} sv_counters;

typedef struct sv_global {
  atomic_llong sessions;
  atomic_llong tensors;
  atomic_llong bytes;
  atomic_llong protocol_errors;  /* also TLS handshake and token failures */
  atomic_llong limit_violations; /* every refused limit, timeouts included */
  dsp_budget *mem; /* --max-memory: parent of every session's budget (owned;
                      NULL: no server-wide cap, as in fuzzers and tests) */
  atomic_llong sessions_detached; /* waiting for a resume now */
  atomic_llong sessions_resumed;
  atomic_llong sessions_expired;  /* freed: not resumed within the grace,
                                     or evicted for a new session */
  struct sv_device *devices; /* the server's devices (devices.c); NULL in
                                fuzzers and tests: the CPU backend */
  int n_devices;
  sv_counters m; /* by label, for /metrics */
} sv_global;

/* What one session's running thread has counted and not yet added to
 * sv_global's counters: a chain of small ops paid several atomic adds per
 * op on counters no one reads that often. sv_tally_flush adds it (at the
 * end of every job, so a Stats or a scrape is at most one job behind). */
typedef struct sv_tally {
  long long tensors, bytes;
  long long dev_tensors[SV_MAX_DEVICES], dev_bytes[SV_MAX_DEVICES];
  uint32_t devs;           /* bit i: dev_*[i] may be non-zero */
  uint32_t ops[SV_METRIC_OPS];
  uint64_t op_mask[SV_METRIC_OPS / 64];
  int dirty;
} sv_tally;
/* A tensor of nbytes entering (sign 1) or leaving (-1) a session's table:
 * the server-wide tensors/bytes and its device's. */
void sv_tally_tensor(sv_tally *t, const sv_global *g, const dsp_tensor *x,
                     long long nbytes, int sign);
/* One op run (forward op, or one parameter of an optimizer step). */
void sv_tally_op(sv_tally *t, int op);
/* Adds t to g (and to *session_bytes, the session's own figure) and
 * clears it. */
void sv_tally_flush(sv_tally *t, sv_global *g, atomic_llong *session_bytes);

/* The counting helpers (metrics.c); any thread. */
/* A refusal by limit `which`: also counted in g->limit_violations. */
void sv_count_limit(sv_global *g, sv_limit which);
/* An error reported to a client (an Error reply, a deferred error, a
 * refusal that closes the connection), by code. */
void sv_count_error(sv_global *g, int code);

/* ------------------------------------------------------------ devices */

/* One device of the server: a backend instance with its own memory
 * budget (--device-memory), named "KIND:INDEX". Sessions pick one in their
 * hello; tensors move between them with ToDevice. */
typedef struct sv_device {
  char name[32];   /* "cpu:1" */
  const char *kind;
  dsp_backend *be; /* owned; be->mem is `mem` */
  dsp_budget *mem; /* owned; its limit is --device-memory, none without */
  uint64_t total;  /* reported memory: --device-memory, else --max-memory */
  void (*close)(dsp_backend *be);
  /* A kind whose sessions each get a backend of their own (CUDA: a stream
   * per session, so one session's order is kept while sessions overlap):
   * opens one session's view of be (0, or a code with why) and gives it
   * back. NULL: every session uses be itself (CPU). */
  int (*session_open)(dsp_backend *be, dsp_backend **out, char *why,
                      size_t len);
  void (*session_close)(dsp_backend *view);
} sv_device;
/* Opens every device cfg->devices names (a small table of kinds: adding
 * a backend is a row), into g->devices. 0, or a negative code with a
 * one-line reason in why ("--device cuda:0: ..."), nothing left open. */
int sv_devices_open(const sv_config *cfg, sv_global *g, char *why,
                    size_t len);
void sv_devices_close(sv_global *g);
/* The device a client names: "cpu:1", or a bare kind ("cpu") for its
 * first device; NULL when the server has none of that name (or has no
 * device table). */
const sv_device *sv_device_find(const sv_global *g, const char *name);
/* Fills the wire description of every device (at most SV_MAX_DEVICES;
 * strings point into g) and ptrs[i] = &infos[i]; returns the count. */
size_t sv_device_infos(const sv_global *g, Dspwire__DeviceInfo *infos,
                       Dspwire__DeviceInfo **ptrs);
/* "cpu:0, cpu:1": the names, for messages. */
void sv_device_names(const sv_global *g, char *buf, size_t len);
/* What --device all found beyond the CPU, one line for the log ("cuda:
 * plugin PATH loaded, 0 GPUs: REASON"); "" when all was not given. */
const char *sv_devices_note(void);
struct sv_session;
struct dsp_oprec;
/* The backend session s runs device d's work on: d->be, or for a kind
 * with session views s's own view of it, opened on first use (from the
 * loop or the worker: whichever comes first installs it). 0 with *out,
 * or the open's code (DISPATCH_ENOMEM, a CUDA failure's) with *out
 * untouched and the reason in why[0..len-1]. */
int sv_session_backend(struct sv_session *s, const sv_device *d,
                       const dsp_backend **out, char *why, size_t len);
/* Makes d the device of s (its hello): s->device and its ctx's backend
 * become sv_session_backend's answer. Only before s runs anything. 0, or
 * that function's code and reason. */
int sv_session_use_device(struct sv_session *s, const sv_device *d,
                          char *why, size_t len);
/* Gives s's views back to their devices (teardown, after its tensors). */
void sv_session_backends_close(struct sv_session *s);

/* ------------------------------------------------------------ kinds */

/* What each request kind is, in one table (kinds.c) that the reader, the
 * decoder, the loop and the session all consult: one row per body case,
 * and no list of kinds anywhere else. The hello is the connection's
 * handshake (reader.c, hello.c), not a session request: its row only
 * names it. */
struct sv_job;
typedef struct sv_req_kind {
  const char *name;
  unsigned waits : 1;   /* the client waits for a reply frame */
  unsigned on_loop : 1; /* only reads session state: the loop may answer
                           it when the session has nothing queued */
  unsigned own_turn : 1; /* many ops in one request (Backward, Step): it
                            ends its worker turn (cost SV_TURN_COST) */
  unsigned ends : 1;     /* nothing after it is read (Bye) */
  /* run on the loop only while at most SV_INLINE_TAIL bytes of the same
   * read follow it (an Op: more is a pipeline, net.c) */
  unsigned inline_tail : 1;
  /* many ops: its inline cost is held to what is left of the read's
   * allowance as a whole, not to --inline-cost (a GraphReplay, net.c) */
  unsigned inline_whole : 1;
  /* carries a bulk part: the loop's checks before it is read and the
   * memory it lands in (see sv_upload_prepare); NULL: no bulk allowed */
  int (*bulk)(const sv_config *cfg, dsp_ctx *io_ctx, struct sv_session *s,
              struct sv_job *j, uint64_t bulk_len, int may_wait);
  /* the decoder's check beyond the body being set (decode.c): NULL when
   * r is fine, else the reason (in buf[0..len-1]); NULL: nothing to check */
  const char *(*check)(const Dspwire__Request *r, char *buf, size_t len);
  /* runs the request (handlers.c, graph.c) on the worker, or on the loop
   * for on_loop and inline ones: 0, or a negative code with the reason in
   * why[0..len-1]; NULL: refused as a request without a body */
  int (*exec)(struct sv_session *s, struct sv_job *j, char *why, size_t len);
  /* the output id its failure poisons; NULL: it names none */
  uint64_t (*out)(const Dspwire__Request *r);
  /* the loop's estimate of its work, when the loop could run it
   * (inline.c): 1 with *cost; NULL, or 0: it runs on the pool */
  int (*inline_cost)(struct sv_session *s, const struct sv_job *j,
                     uint64_t *cost);
  /* "op matmul [3, 4] -> 5", for messages and debug logs (kinds.c) */
  void (*describe)(const Dspwire__Request *r, char *buf, size_t len);
} sv_req_kind;
/* The kind of a body case; an unknown case gets a kind with no flags and
 * no functions, named "unknown". */
const sv_req_kind *sv_req_kind_of(Dspwire__Request__BodyCase bc);
/* Whether this request gets a reply: its kind's, except a 1.3 Backward
 * sent with no_reply. */
int sv_req_waits(const Dspwire__Request *r);

/* The one formatter of a failure's reason: why[0..len-1] gets the
 * message, and code is returned, so a check reads
 * `return sv_why(why, len, DISPATCH_EINVAL, "...", ...)`. */
int sv_why(char *why, size_t len, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The one conversion of a wire message's attributes (Op, Step, GraphNode)
 * into the core's: 0, or DISPATCH_EINVAL with *a untouched when there are
 * more ints or floats than dsp_attrs holds (the caller words the refusal:
 * each names its own context). */
int sv_attrs_from(size_t n_ints, const int64_t *ints, size_t n_floats,
                  const double *floats, dsp_attrs *a);

/* ------------------------------------------------------------ jobs */

typedef enum sv_job_kind {
  SV_JOB_REQUEST = 0, /* a decoded request */
  SV_JOB_TEARDOWN,    /* frees the session; the last job of a session */
} sv_job_kind;

struct sv_session;
struct dsp_oprec;

typedef struct sv_job {
  struct sv_job *next;
  sv_job_kind kind;
  struct sv_session *sess;
  Dspwire__Request *req; /* owned; NULL for teardown */
  dsp_tensor *upload;     /* owned upload tensor, filled from the bulk */
  dsp_stage upload_stage; /* where the bulk lands: the backend's staging of
                             upload, committed when the upload runs */
  uint64_t upload_bytes;  /* counted in sess->queued_bytes until
                             sv_session_exec takes the job */
  int pre_err;            /* an error found while reading (deferred) */
  char *pre_msg;          /* its detail (owned, may be NULL) */
  uint64_t t0;            /* uv_hrtime() when its message was decoded: the
                             request latency runs to its result being
                             back on the loop */
  /* results, filled by the worker: one frame ready to write */
  uint8_t *out;
  size_t out_len;
  int bulk_by_ref;   /* set by the loop: a Read reply may send the
                        tensor's bytes without a copy (out_pin) */
  dsp_pin *out_pin;  /* the Read's snapshot whose bytes follow out on the
                        wire (out's header counts them); NULL: none */
  int is_bye;
  /* an Ops request: the offset in its records where the next run starts
   * (the loop may run the first records inline and hand the rest to a
   * worker); gate, when set, is asked for each record once it is checked
   * and its cost known (dsp_op_cost), before it runs, and a refusal stops
   * the run there (inline, net.c) */
  size_t ops_at;
  int (*gate)(void *ud, struct sv_session *s, dsp_tensor *const *in,
              int n_in, uint64_t cost);
  void *gate_ud;
} sv_job;

void sv_job_free(sv_job *j);

/* ------------------------------------------------------------ sessions */

#define SV_SPARE_ENTRIES 256
typedef struct sv_entry {
  dsp_tensor *t;   /* NULL when poisoned */
  int poison_code; /* the original failure's code */
  char *poison;    /* "request 7 (op matmul 3,4 -> 5): reason" (owned) */
  uint64_t charged; /* to the session budget: this entry, its id slot and
                       its message (the tensor charges itself) */
} sv_entry;

/* The protobuf-c allocator a session decodes its requests with: every
 * block is charged to the session budget until the request is freed (by
 * any allocator of this file's kind: the block remembers its budget). */
typedef struct sv_pb_charge {
  ProtobufCAllocator pb; /* first: protobuf-c hands &pb back as ud */
  dsp_budget *budget;
  struct pb_arena *arena; /* the request being decoded (encode.c) */
  size_t hint;            /* its message's length, before its first block */
  int refused;   /* the last decode failed on the budget */
  char why[256]; /* its message */
} sv_pb_charge;

typedef struct sv_session {
  /* worker side */
  dsp_ctx *ctx;     /* its backend is the session's device, except while a
                       creation op that names another runs */
  const dsp_backend *device; /* the session's device: set before the first
                                job (new, hello), then only read, by the
                                loop (uploads) and the worker */
  /* the protocol minor of the hello that opened the session, set and read
   * as device is: the dtypes its client can name and be sent
   * (dsp_dtype_wire_minor; sv_dtype_for_client) */
  unsigned peer_minor;
  /* its view of g->devices[i] for a kind with session views (NULL until
   * first used; sv_session_backend) */
  _Atomic(dsp_backend *) views[SV_MAX_DEVICES];
  sv_idmap tensors; /* id -> sv_entry* */
  /* freed entries kept for the next insert, each still charged its id's
   * cost to budget (session.c) */
  struct sv_entry *spare[SV_SPARE_ENTRIES];
  int n_spare;
  sv_idmap grads;   /* id -> dsp_grads* */
  sv_idmap graphs;  /* id -> captured graph (graph.c) */
  uint64_t n_live;  /* tensors that are not poisoned */
  uint64_t n_ops, n_errors;
  uint64_t n_batches; /* worker turns the session had (Stats "batches") */
  uint64_t n_inline;  /* ops the loop ran itself (Stats "inline_ops") */
  uint64_t n_handoffs; /* loop -> pool submissions (Stats "handoffs") */
  uint64_t n_returns;  /* pool -> loop deliveries (Stats "returns") */
  uint64_t turn_cost; /* work run in this turn (pool.c): dsp_op_cost of
                         its ops, upload bytes, 1 for any other request;
                         a Backward or Step sets it to SV_TURN_COST */
  int err_code; /* first deferred error, 0 when none */
  uint64_t err_req;
  char err_msg[640];
  /* shared */
  dsp_budget *budget;        /* --max-session-bytes, inside global->mem */
  dsp_budget *queue;         /* --max-queued-bytes, inside global->mem: the
                                decoded requests; apart from budget so a
                                session that holds all it may can still
                                send the Free that gets it out */
  sv_pb_charge pb;           /* decodes this session's requests (loop) */
  atomic_llong bytes;        /* bytes of the tensors in the table (as of
                                the end of the last job: see tally) */
  sv_tally tally;            /* worker side: counts not yet in global */
  atomic_llong queued_bytes; /* upload bytes read but not yet run */
  const sv_config *cfg;
  sv_global *global;
  /* pool scheduling, guarded by the pool mutex */
  sv_job *fifo_head, *fifo_tail;
  int scheduled; /* on the run queue or running */
  int running;
  struct sv_session *runq_next;
  void *owner; /* the connection (loop side); NULL while detached */
  unsigned long long log_id; /* the connection's id, for log lines */
  struct sv_resume *rs; /* resume state (loop side); NULL: not resumable */
} sv_session;

/* Creates the worker-side state; NULL when out of memory. */
sv_session *sv_session_new(const sv_config *cfg, sv_global *g, void *owner);
/* Frees every tensor, gradient container and the ctx (worker side: run
 * from the teardown job), and takes the session's bytes out of the
 * server-wide counters. The struct itself stays for the loop to free. */
void sv_session_teardown(sv_session *s);
/* The one admission check for the shape of a tensor a session is about to
 * hold (an upload's meta, an op's result, shapes taken from attributes):
 * validates m (dsp_meta_span) and holds its span, not only its element
 * count, to --max-elements, so an empty [2^40, 0] is refused like a full
 * one. what prefixes the message ("upload", "result"). 0 with
 * *numel set, or a negative code with the message in msg[0..len-1]; limit
 * refusals are counted in g. */
int sv_check_meta(const sv_config *cfg, sv_global *g, dsp_ctx *ctx,
                  const dsp_meta *m, const char *what, int64_t *numel,
                  char *msg, size_t len);
/* 1.7: 0 when the session's client (the minor of its hello) can name and
 * be sent a tensor of dtype dt; else DISPATCH_EDTYPE with "WHAT: bf16
 * needs protocol 1.7; the client speaks 1.6" in msg[0..len-1] (what: "read
 * 5", "upload"). The one check before a half tensor crosses the wire. */
int sv_dtype_for_client(const sv_session *s, int dt, const char *what,
                        char *msg, size_t len);
/* Cancels the session's running op, and every later one (loop thread, on
 * disconnect and shutdown, before its teardown job is submitted): the
 * kernel stops at its next block and the request fails with
 * DISPATCH_ECANCELED. */
void sv_session_cancel(sv_session *s);
/* Runs one request job on a worker; fills job->out for waiting requests. */
void sv_session_exec(sv_session *s, sv_job *j);

/* Captured graphs (graph.c, protocol 1.2), on the worker: GraphDefine and
 * GraphReplay (0 or a negative code with the reason in why[0..len-1]; a
 * replay fills j->out), Free.graphs (0 or DISPATCH_ENOID) and teardown. */
int sv_graph_define(sv_session *s, sv_job *j, char *why, size_t len);
int sv_graph_replay(sv_session *s, sv_job *j, char *why, size_t len);
int sv_graph_free_id(sv_session *s, uint64_t id);
/* What sv_graph_free_id(s, id) costs, in dsp_op_cost units (0: no such
 * graph), for the loop's judgement of a Free (inline.c) */
uint64_t sv_graph_free_cost(sv_session *s, uint64_t id);
/* 1 with *cost (the work of its last replay plus bulk, its input bytes)
 * when the GraphReplay j, read without error, will do what the last
 * successful replay of its graph did: its externals have the metas they
 * had then and live, as the session's device, on a CPU device. The loop's
 * judgement (its kind's inline_cost); only while s is idle. */
int sv_graph_inline_cost(sv_session *s, const sv_job *j, uint64_t *cost);
void sv_graph_teardown(sv_session *s);
/* On the loop: the host block a GraphReplay's bulk lands in, charged to
 * the session (its kind's bulk; see sv_upload_prepare). */
int sv_graph_replay_prepare(const sv_config *cfg, dsp_ctx *io_ctx,
                            sv_session *s, sv_job *j, uint64_t bulk_len,
                            int may_wait);

/* Sets w to the wire form of m (dtype and shape); w->shape points into
 * m->shape, which must outlive the encoding of w. */
void sv_wire_meta(Dspwire__TensorMeta *w, const dsp_meta *m);
/* Encodes a reply frame (header + message + bulk copy) into one buffer
 * from dsp_malloc. 0 or DISPATCH_ENOMEM / DISPATCH_ETOOLARGE. */
int sv_encode_reply(const Dspwire__Reply *r, const void *bulk,
                    size_t bulk_len, uint8_t **out, size_t *out_len);
/* j's answer without bulk: r (its body set by the caller, or none) with
 * j's req_id, encoded into j->out. 0, or the code with "WHAT: out of
 * memory for the reply" in why (what NULL: no prefix). */
int sv_job_reply(struct sv_job *j, Dspwire__Reply *r, const char *what,
                 char *why, size_t len);
/* A Read reply for t into j: with j->bulk_by_ref and a tensor past a few
 * pages, j->out is the header and message only and j->out_pin a pin of t
 * (the bytes as they are now, whatever later requests write in place,
 * until the loop releases it once they are sent); otherwise the bytes are
 * copied into j->out. 0 or DISPATCH_ENOMEM /
 * DISPATCH_ETOOLARGE. */
int sv_encode_read_reply(dsp_ctx *ctx, const Dspwire__Reply *r,
                         dsp_tensor *t, sv_job *j);
/* As sv_encode_read_reply for bytes already pinned: takes the caller's
 * pin whatever the outcome (released here on failure or after a copy). */
int sv_encode_pin_reply(const Dspwire__Reply *r, dsp_pin *pin, sv_job *j);
/* A reply whose bulk is the bytes of ts[0..n-1] in order (a GraphReply)
 * into j, each tensor's bytes copied once. One tensor: as a Read's reply
 * (sv_encode_read_reply). Several, past a few pages and with
 * j->bulk_by_ref: the bytes are copied into one host block charged to
 * ctx's budget before anything is copied (refused when it does not fit),
 * j->out is the header and message and j->out_pin a pin of the block,
 * which keeps the charge until the loop releases it once sent; otherwise
 * copied into j->out. 0, or DISPATCH_EQUOTA / DISPATCH_ENOMEM /
 * DISPATCH_ETOOLARGE / a backend's read error, with the detail in ctx. */
int sv_encode_tensors_reply(dsp_ctx *ctx, const Dspwire__Reply *r,
                            dsp_tensor *const *ts, size_t n, sv_job *j);
/* An Error reply frame (req_id, code, message, failed_req_id). */
int sv_encode_error(uint64_t req_id, int code, const char *msg,
                    uint64_t failed_req, uint8_t **out, size_t *out_len);

/* protobuf-c allocator over dsp_malloc (uncharged); frees blocks of any
 * session's allocator too */
extern ProtobufCAllocator sv_pb_allocator;
/* Sets up pc to charge b (the caller keeps b alive while pc is used). */
void sv_pb_charge_init(sv_pb_charge *pc, dsp_budget *b);
/* Ends the decode of one request through pc (set pc->hint to the
 * message's length before it): its arena's charge is cut to what it
 * used. */
void sv_pb_charge_done(sv_pb_charge *pc);

/* Short description of a request for messages and debug logs, by its
 * kind's describe (kinds.c): "op matmul [3, 4] -> 5", "upload 7 f32
 * [2, 3]"; "empty request" for a kind without one. */
void sv_describe(const Dspwire__Request *r, char *buf, size_t len);
/* One record of an Ops request, as sv_describe writes the Op it stands
 * for ("op add [3, 4] -> 5"). */
void sv_describe_record(const struct dsp_oprec *r, char *buf, size_t len);

/* ------------------------------------------------------------ decode
 * The socket-free steps of reading a request (decode.c), shared by reader.c,
 * the fuzzers and the regression suite. why receives the detail. */
struct dsp_frame_header;
/* Header limits: flags 0, msg_len in 1..max_msg, msg_len + bulk_len at
 * most max_frame. 0 or DISPATCH_EPROTO / DISPATCH_ETOOLARGE. */
int sv_decode_header(const sv_config *cfg, const uint8_t *in16,
                     struct dsp_frame_header *h, char *why, size_t why_len);
/* Protobuf decode + structural rules (body set, hello first and once, bulk
 * only on uploads, known op code). 0 with *out owned by the caller, or
 * DISPATCH_EPROTO with *out NULL and *req_id the id when it decoded. */
int sv_decode_request(const uint8_t *msg, size_t len, uint64_t bulk_len,
                      int hello_done, Dspwire__Request **out,
                      uint64_t *req_id, char *why, size_t why_len);
/* The same, with what the decoded request holds charged to s's queue
 * budget (s NULL: uncharged). A request whose decoded form does not fit returns
 * DISPATCH_EQUOTA (nothing kept) with *req_id and *body (the request's
 * kind) read from the raw message, so the caller can wait for queued work
 * to finish or defer the error instead of closing the connection. */
int sv_decode_request_charged(sv_session *s, const uint8_t *msg, size_t len,
                              uint64_t bulk_len, int hello_done,
                              Dspwire__Request **out, uint64_t *req_id,
                              int *body, char *why, size_t why_len);
/* Records a failure of a request that never reached a worker as the
 * session's deferred error (or, for a request that waits for a reply,
 * encodes that reply into *out). Call only while no job of s is queued or
 * running (sv_pool_session_idle). */
void sv_session_defer(sv_session *s, uint64_t req_id, int body, int code,
                      const char *msg, uint8_t **out, size_t *out_len);
/* The bulk step of j's kind (sv_req_kind.bulk; nothing for a kind
 * without a bulk): for an Upload its limits, then the tensor the bulk
 * lands in (j->upload, counted in s->queued_bytes) or a deferred error in
 * j; for a GraphReplay the block its inputs land in. 1 (nothing done)
 * when only the quota fails and may_wait is set; otherwise 0. */
int sv_upload_prepare(const sv_config *cfg, dsp_ctx *io_ctx, sv_session *s,
                      sv_job *j, uint64_t bulk_len, int may_wait);
/* The Upload kind's bulk step (the Upload half of sv_upload_prepare). */
int sv_upload_bulk(const sv_config *cfg, dsp_ctx *io_ctx, sv_session *s,
                   sv_job *j, uint64_t bulk_len, int may_wait);
/* The decoder's checks of an Op (a known op code) and of an Ops request
 * (its records' layout: at least one, at most DSP_OPREC_MAX, each whole
 * and of a known op code): NULL when fine, else the reason (in buf). */
const char *sv_check_op(const Dspwire__Request *r, char *buf, size_t len);
const char *sv_check_ops(const Dspwire__Request *r, char *buf, size_t len);

typedef struct sv_stream_stats {
  uint64_t frames;    /* frames decoded (hello included) */
  uint64_t executed;  /* requests run by sv_session_exec */
  uint64_t replies;   /* reply frames produced (each decoded back) */
  uint64_t error_replies;
  int first_error;    /* code of the first error reply, 0 when none */
  int truncated;      /* the stream ended inside a frame */
  int bye;            /* stopped at a bye */
} sv_stream_stats;
/* Runs a byte stream of frames against s synchronously, as a connection
 * would (no sockets, no pool): for fuzzers and tests. Returns 0, or the
 * protocol error that would close the connection (DISPATCH_EPROTO,
 * DISPATCH_ETOOLARGE, DISPATCH_EVERSION), DISPATCH_ENOMEM, or
 * DISPATCH_EINTERNAL for a reply frame that does not decode. *hello_done
 * says whether the hello was seen and is updated. */
int sv_stream_exec(sv_session *s, dsp_ctx *io_ctx, int *hello_done,
                   const uint8_t *p, size_t n, sv_stream_stats *st);

/* ------------------------------------------------------------ inline */

/* --inline-cost: the default admits an add of about 8000 floats, a few
 * microseconds of kernel work, well under the two thread wake-ups a
 * worker costs (tens of microseconds each on a virtual machine); the
 * option refuses values over SV_INLINE_COST_MAX (2^20, about a
 * millisecond), so the loop never runs anything long. */
#define SV_INLINE_COST_DEFAULT (1ULL << 14)
/* --loop-spin-us: after answering a request itself, the network thread
 * polls without sleeping this long (net.c), about one loopback round trip
 * of a client that sends its next request on the reply */
#define SV_LOOP_SPIN_US_DEFAULT 50
#define SV_LOOP_SPIN_US_MAX 10000
#define SV_INLINE_COST_MAX (1ULL << 20)
/* What one connection's inline ops may cost together per socket read
 * (each op counts its dsp_op_cost plus SV_INLINE_OP_BASE for decoding,
 * tables and allocation; the op that crosses the line still runs, so the
 * bound is this plus one op): past it the rest of what was read goes to
 * the pool, where the loop decodes while a worker runs, and other
 * connections wait at most about this long behind one. */
#define SV_INLINE_OP_BASE 1024
/* The same for one record of an Ops request: no protobuf message of its
 * own to decode and free, so a quarter */
#define SV_INLINE_REC_BASE 256
/* 2^20: a read of 64 KiB packed with tiny Ops records (about 2000 of
 * them, a few hundred microseconds) runs whole on the loop; handing its
 * tail to a worker would send the session's next reads there too, until
 * it is idle again, at two wake-ups a turn. About a millisecond of
 * kernel work at most. */
#define SV_INLINE_READ_COST (1ULL << 20)
/* An op runs inline only when at most this many bytes of the same socket
 * read follow its frame: room for the Read or Sync (and a Free) a client
 * sends behind a few ops before it waits. More is a pipeline, which runs
 * faster on a worker while the loop decodes the rest. */
#define SV_INLINE_TAIL 256

/* 1 with *cost set when job j is of a kind the loop could run for s (its
 * row's inline_cost, kinds.c): an op whose inputs live on a CPU device and
 * whose shapes infer; a Free of tensor ids and graphs (cost: one per id
 * and per element it holds, the tape a last reference drops, a graph's
 * nodes); an upload to a CPU device (cost: its bytes); a GraphReplay
 * (sv_graph_inline_cost); 0 otherwise.
 * Reads s's tensor table: call only while s is idle
 * (sv_pool_session_idle). */
int sv_inline_cost(sv_session *s, const sv_job *j, uint64_t *cost);
/* The same per kind (their rows' inline_cost, inline.c): an Op, an Upload,
 * a Free. */
int sv_inline_op_cost(sv_session *s, const sv_job *j, uint64_t *cost);
int sv_inline_upload_cost(sv_session *s, const sv_job *j, uint64_t *cost);
int sv_inline_free_cost(sv_session *s, const sv_job *j, uint64_t *cost);
/* 1 when an op on inputs in[0..n_in-1] (checked, alive) runs on a CPU
 * device, as does a creation op (n_in 0) on s's device: the loop may run
 * it. For an Ops record, whose inputs earlier records of the same request
 * may make, this is asked when it is about to run. */
int sv_inline_placed(const sv_session *s, dsp_tensor *const *in, int n_in);

/* ------------------------------------------------------------ pool */

/* One turn of a session on a worker (pool.c): at most this many jobs, and
 * it ends once the jobs run have cost this much (2^24 elementary
 * operations: a few milliseconds of kernel work, well under one op at
 * --max-op-cost), so batching small ops does not let a long queue keep a
 * worker from other sessions. */
#define SV_TURN_JOBS 256
#define SV_TURN_COST (1ULL << 24)
/* A worker that goes on with the same session holds the finished jobs of
 * a turn without a reply for the next turn, at most this many (pool.c):
 * the loop learns of them a little later, and sees them in its in-flight
 * count and queue budget until then */
#define SV_CARRY_JOBS 64
/* The jobs one socket read decodes go to the pool together, and in
 * batches of this many when there are more, so a worker starts on a long
 * pipeline while the loop decodes the rest of it (net.c) */
#define SV_SUBMIT_BATCH 16

typedef struct sv_pool sv_pool;
/* Starts n workers. done_cb runs on the loop thread (woken through an
 * eventfd) for each finished job, in completion order. NULL on failure. */
typedef void (*sv_done_fn)(sv_job *j, void *ud);
sv_pool *sv_pool_new(void *uv_loop, int n, sv_done_fn done, void *ud);
/* Appends a job to its session's FIFO and schedules the session. */
void sv_pool_submit(sv_pool *p, sv_job *j);
/* The same for the jobs head..tail (linked by next, all of one session),
 * in order, with one lock round and at most one wake-up. */
void sv_pool_submit_list(sv_pool *p, sv_job *head, sv_job *tail);
/* 1 when no job of s is queued or running, so the caller (the loop, the
 * only thread that submits) may touch the worker-side state of s until it
 * submits again: the pool mutex orders the last worker's writes before
 * this check. */
int sv_pool_session_idle(sv_pool *p, sv_session *s);
/* 1 when no worker runs a job and none is queued (a hint: the loop, the
 * only thread that submits, may submit right after). */
int sv_pool_idle(sv_pool *p);
/* Removes the jobs of s that have not started and returns them (a list). */
sv_job *sv_pool_cancel(sv_pool *p, sv_session *s);
/* Stops and joins the workers (call when no session has jobs left) and
 * closes its eventfd watch; the pool is freed in its close callback, so
 * the loop must run once more. */
void sv_pool_close(sv_pool *p);

/* ------------------------------------------------------------ tls */

/* The server's TLS context (tls.c), built once from the config; each
 * connection gets an SSL object over two memory BIOs so the loop never
 * blocks: bytes read from the socket go in with sv_tls_feed, bytes to send
 * come out with sv_tls_take. */
typedef struct sv_tls_ctx sv_tls_ctx;
typedef struct sv_tls sv_tls;
/* Loads cert, key and optional client CA; NULL with a message on stderr
 * (naming the file and OpenSSL's reason) when any cannot be used. */
sv_tls_ctx *sv_tls_ctx_new(const sv_config *cfg);
/* SIGHUP (loop thread): loads the same files again into a new context
 * that the next sv_tls_new uses; connections already made keep the old
 * one until they end. 0, or DISPATCH_ETLS with t unchanged and the reason
 * ("cannot load the private key FILE: ...") in why[0..len-1]. */
int sv_tls_ctx_reload(sv_tls_ctx *t, const sv_config *cfg, char *why,
                      size_t len);
void sv_tls_ctx_free(sv_tls_ctx *t);
sv_tls *sv_tls_new(sv_tls_ctx *t);
void sv_tls_free(sv_tls *s);
/* Feeds n ciphertext bytes; 0 or DISPATCH_ENOMEM. */
int sv_tls_feed(sv_tls *s, const void *p, size_t n);
/* Advances the handshake: 1 done, 0 needs more input, or DISPATCH_ETLS
 * with the reason in why. */
int sv_tls_handshake(sv_tls *s, char *why, size_t why_len);
/* Decrypts up to n bytes into dst: >0 bytes, 0 needs more input, -1 the
 * peer closed the TLS session, DISPATCH_ETLS with why. */
long sv_tls_read(sv_tls *s, void *dst, size_t n, char *why, size_t why_len);
/* Encrypts n bytes into the output BIO; 0 or DISPATCH_ETLS/ENOMEM. */
int sv_tls_write(sv_tls *s, const void *p, size_t n);
/* Takes all pending ciphertext as one dsp_malloc buffer (*out NULL when
 * there is none); 0 or DISPATCH_ENOMEM. */
int sv_tls_take(sv_tls *s, uint8_t **out, size_t *len);
/* Subject of the verified client certificate, "" when none. */
void sv_tls_peer_name(sv_tls *s, char *buf, size_t len);
/* SHA-256 of the verified client certificate (DER) into out: 1, 0 with
 * zeros when there is none, -1 (0xff bytes) when it cannot be hashed. */
int sv_tls_peer_digest(sv_tls *s, uint8_t out[32]);

#endif
