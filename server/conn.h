/* A connection, split by concern so each limit sits in one place:
 *
 *   net.c       lifecycle: accept, close, timers, finished jobs, sv_run
 *   reader.c    the frame reader: header limits (the pre-hello cap), the
 *               frame timeout, decoding, uploads, backpressure
 *   writer.c    the reply queue: one ordered list of frames, its byte
 *               limit, bulks sent in pieces
 *   hello.c     hello and authentication
 *   keepalive.c 1.4 keepalives: a busy session tells its waiting client
 *               it is alive
 *   transport.c plain TCP and TLS behind one table (sv_transport); nothing
 *               outside it asks which one a connection has
 *
 * All of this runs on the loop thread (checked in debug builds where a
 * connection is made, hands work over, gets it back, closes and is freed:
 * sv_on_loop, SV_DEBUG_CHECK in sv.h). */
#ifndef SV_CONN_H
#define SV_CONN_H

#include <uv.h>

#include "frame.h"
#include "sv.h"

/* ST_WAIT: an upload's header is decoded but the quota cannot be judged
 * until the session's earlier requests (a free, say) have run; reading
 * stops and the unparsed rest of rbuf is kept for later. */
enum { ST_HEADER, ST_MSG, ST_BULK, ST_WAIT, ST_DEAD };
#define RBUF_SIZE 65536
/* The largest piece of one frame handed to the socket (or to TLS) in one
 * call (libuv's buffer lengths are unsigned int, so it must be below 4
 * GiB). 1 MiB: writing a Read's whole bulk in one call (then a piece of
 * 1 GiB) held the socket while the reader's acknowledgements waited; a
 * 64 MiB read ran at 3.4 GB/s, and 4.6 GB/s in 1 MiB pieces (256 KiB:
 * 3.2-4.3, 512 KiB: 4.4-5.2 but a 1 MiB read 6.7-8.3 against 8.5, 2 MiB:
 * 4.3-4.7). */
#define SV_WRITE_PIECE (1u << 20)
/* Frames before a successful hello are at most this (message + bulk): a
 * Hello with a token and a client name fits, and an unauthenticated peer
 * cannot make the server allocate more. */
#define SV_PREAUTH_FRAME_MAX 4096u

typedef struct sv_server sv_server;

/* Request latency buckets (seconds) of dispatch_request_duration_seconds;
 * SV_BODY_MAX bounds the request body cases (kinds.c). */
#define SV_LAT_BUCKETS 16
#define SV_BODY_MAX 16

/* What only the loop thread counts (plain integers: one writer); the
 * metrics thread sees them through the snapshot the loop publishes
 * (metrics.c). */
typedef struct sv_loop_stats {
  uint64_t opened;                  /* connections accepted */
  uint64_t in_closed, out_closed;   /* bytes of connections already freed */
  uint64_t lat[SV_BODY_MAX][SV_LAT_BUCKETS + 1]; /* per bucket, not
                                                     cumulative; last: +Inf */
  uint64_t lat_ns[SV_BODY_MAX];     /* sum of the latencies */
} sv_loop_stats;
typedef struct sv_conn sv_conn;

/* One reply frame waiting to leave: buf, then the bytes of a pinned Read
 * (bulk: the tensor as it was when the Read ran, sent without a copy). */
typedef struct sv_out {
  struct sv_out *next;
  uint8_t *buf;
  size_t len;
  dsp_pin *bulk;
  size_t bulk_len;
  size_t done; /* bytes of buf, then bulk, already taken by the transport */
} sv_out;

/* What the output limit charges for a queued frame besides its bytes:
 * the sv_out, a pin's bookkeeping, and the allocator's headers and
 * rounding of each block. A client that pipelines tiny requests and never
 * reads is bounded by what the server holds for it, not by its payload
 * (~20 bytes of a sync reply that costs ~100 more to keep). */
#define SV_OUT_COST (sizeof(sv_out) + 96u)

/* Plain TCP or TLS. Every hook runs on the loop thread. */
typedef struct sv_transport {
  const char *name;
  /* Per-connection state after accept; 0 or DISPATCH_ENOMEM. */
  int (*open)(sv_conn *c);
  /* Frees it (the handles are closed). */
  void (*free)(sv_conn *c);
  /* Where the next socket read lands (may point into an upload's tensor). */
  void (*alloc)(sv_conn *c, uv_buf_t *buf);
  /* n bytes arrived in buf (from alloc). */
  void (*on_bytes)(sv_conn *c, const uv_buf_t *buf, size_t n);
  /* Delivers input the transport already holds (reading was paused). */
  void (*resume)(sv_conn *c);
  /* Moves queued frames (c->oq_head) towards the socket as it takes them;
   * called when a frame is queued and when a socket write completes. */
  void (*send)(sv_conn *c);
  /* 1 when a frame can be sent now (TLS: the handshake is done). */
  int (*ready)(const sv_conn *c);
} sv_transport;

extern const sv_transport sv_transport_tcp;
extern const sv_transport sv_transport_tls;

/* A socket write in flight. Plain TCP has at most one (frames wait in the
 * queue meanwhile); TLS may add handshake or alert records behind one. */
typedef struct sv_write {
  uv_write_t req;
  uint8_t *owned; /* freed in on_write (TLS ciphertext), or NULL: the
                     bytes are the front of the frame queue */
  size_t len;     /* bytes in flight */
} sv_write;

struct sv_conn {
  uv_tcp_t tcp; /* first: the handle pointer is the conn pointer */
  uv_timer_t idle;
  uv_timer_t hs;    /* handshake timeout: TLS handshake + hello */
  uv_timer_t frame; /* one frame must arrive within --frame-timeout */
  uv_timer_t ka;    /* keepalive ticks (keepalive.c), when asked for */
  const sv_transport *tp;
  void *tpd; /* the transport's per-connection state */
  sv_server *srv;
  sv_session *sess;
  sv_job *teardown; /* allocated up front so closing never fails */
  struct sv_conn *prev, *next;
  unsigned long long id;
  char peer[96];
  int over_limit; /* refuse with ELIMIT once the transport can carry it */
  /* reader: keeps its place across partial reads */
  int state;
  uint8_t hdr[DSP_FRAME_HEADER_SIZE];
  size_t hdr_got;
  uint8_t *msg;
  uint32_t msg_len, msg_got;
  uint64_t bulk_len, bulk_got;
  uint8_t *bulk_dst; /* NULL: the bulk is read and discarded */
  sv_job *bulk_job;
  sv_job *wait_job;    /* ST_WAIT: the upload waiting for the FIFO */
  const uint8_t *pend; /* ST_WAIT: unparsed bytes left in rbuf */
  size_t pend_n;
  int hello_done;
  int in_frame; /* a frame's first byte arrived, its last not yet */
  /* writer */
  sv_out *oq_head, *oq_tail; /* frames not yet handed to the socket */
  int writes_pending;        /* sv_writes in flight */
  uint64_t sent;             /* bytes the socket took, ever */
  uint64_t received;         /* bytes read from the socket, ever */
  uint64_t sent_at_idle;     /* sent at the last idle tick */
  uint64_t outq_bytes; /* unsent reply bytes + SV_OUT_COST a frame */
  uint32_t ka_ms;      /* keepalive interval (ms), 0: none */
  uint64_t ka_sent;    /* sent at the last keepalive tick */
  /* lifecycle */
  int closing, close_after_flush, paused, handles_open, teardown_done;
  /* closed by the server for a limit (it took none of its replies): once
   * detached, its session is the first to go for a new one (resume.c) */
  int limit_closed;
  uint32_t inflight;
  /* jobs of the socket read being handled, not yet handed to the pool:
   * they go as one batch at its end (or every SV_SUBMIT_BATCH jobs), so a
   * read of several requests wakes one worker once (net.c) */
  sv_job *sub_head, *sub_tail;
  uint32_t sub_n;
  int sub_batching; /* in on_read: submits are collected */
  uint64_t inline_left; /* inline op cost left until the next socket read
                           (SV_INLINE_READ_COST a read) */
  size_t read_left;     /* bytes of the current read after the message
                           being handled */
  unsigned long long n_requests;
  uint8_t rbuf[RBUF_SIZE];
};

#define SV_EVICTED_KEPT 64 /* evicted sessions remembered (resume.c) */

struct sv_server {
  uv_loop_t loop;
  pthread_t loop_thread; /* the one that runs loop (sv_run's) */
  uv_tcp_t listener;
  uv_signal_t sigint, sigterm;
  uv_signal_t sighup; /* reload.c */
  int sighup_open;
  /* the token a hello must present: --token-file's, replaced on SIGHUP
   * (reload.c); NULL: none required */
  char *token;
  size_t token_len;
  uv_timer_t drain; /* --drain-timeout, from the first signal */
  /* --loop-spin-us: while active, the loop polls without sleeping (net.c
   * sv_loop_spin), until spin_until (uv_hrtime) */
  uv_idle_t spin;
  uint64_t spin_until;
  const sv_config *cfg;
  sv_global g;
  sv_pool *pool;
  sv_tls_ctx *tls; /* NULL: plain TCP */
  dsp_ctx *io_ctx; /* loop-thread ctx for upload allocation */
  unsigned long long next_id;
  int n_conns;
  int shutting_down; /* a signal came: draining, then stopping */
  int cut_off;       /* the drain ended (timeout or a second signal) */
  int handles_closed; /* the server's own handles, at the very end */
  sv_conn *conns;
  sv_loop_stats ls;
  struct sv_metrics *metrics; /* --metrics-listen, NULL when off */
  /* resume.c: every session that may be resumed (attached or not) */
  struct sv_resume *resumable;
  int n_held;       /* detached sessions, and expired ones not yet freed */
  uv_timer_t sweep; /* frees detached sessions past their grace */
  int sweep_open;
  /* detached sessions expired to make room for a new one, the latest
   * SV_EVICTED_KEPT (a ring), so a resume of one is told why */
  struct sv_evicted {
    uint8_t token_digest[32]; /* SHA-256 of its resume token */
    uint64_t detached_ms;     /* how long it had been detached */
    int limit_closed;         /* the server had closed its connection */
  } evicted[SV_EVICTED_KEPT];
  unsigned n_evicted; /* ever: the next goes to n_evicted % KEPT */
  uint64_t n_detaches; /* ever */
};

/* 1 on srv's loop thread: what SV_DEBUG_CHECK asks of the connection code */
static inline int sv_on_loop(const sv_server *srv) {
  return pthread_equal(pthread_self(), srv->loop_thread) != 0;
}

/* ------------------------------------------------------------ resume.c */

#define SV_RESUME_TOKEN 32 /* bytes of the resume token (256 bits) */
#define SV_RESUME_CRED 32
#define SV_RESUME_CACHE 8  /* replies kept per session until acknowledged */

typedef struct sv_rreply {
  uint64_t seq;
  uint8_t *buf; /* the reply frame */
  size_t len;
  dsp_pin *bulk;  /* a Read's bytes by reference, sent after buf; or NULL */
  size_t charged; /* to the session queue: len, or 0 for an error stub */
} sv_rreply;

/* What lets a session outlive its connection (loop thread only). */
typedef struct sv_resume {
  struct sv_resume *prev, *next; /* sv_server.resumable */
  sv_server *srv;
  sv_session *sess;
  sv_conn *conn;           /* attached to; NULL while detached */
  uint8_t token[SV_RESUME_TOKEN];
  uint8_t cred[SV_RESUME_CRED]; /* digest of the opening credentials */
  uint8_t cert[32];        /* the client certificate's digest (zeros:
                              none), to bind cred to a new token */
  uint64_t last_seq;       /* highest seq received in full */
  uint64_t deadline;       /* detached: uv_now() when it is freed */
  sv_job *teardown;        /* detached: the session's teardown job */
  uint32_t inflight;       /* detached: its jobs still queued or running */
  int expired;
  int limit_closed;        /* detached: the server closed its connection */
  uint64_t detach_no;      /* detached: srv->n_detaches then (the order) */
  sv_rreply cache[SV_RESUME_CACHE]; /* oldest first */
  int n_cache;
} sv_resume;

/* A new session whose hello asked for it becomes resumable: a fresh
 * token from RAND_bytes and the digest of token + client certificate.
 * Nothing when --session-grace is 0. 0 or a negative code. */
int sv_resume_open(sv_conn *c, const char *token);
/* The connection of a resumable session dropped: the session is kept
 * (its queued requests still run) and c lets go of it. 1 when detached;
 * 0 when it is not resumable (bye, refusal, shutdown): close as usual. */
int sv_resume_detach(sv_conn *c);
/* Attaches the session h->resume_token names to c in place of the one c
 * opened with (*fresh, whose teardown is submitted). 0, or
 * DISPATCH_ESESSION / DISPATCH_EAUTH with the reason in msg. */
int sv_resume_attach(sv_conn *c, const Dspwire__Hello *h, sv_session **fresh,
                     char *msg, size_t len);
/* SIGHUP replaced the server's token old with fresh: every session
 * opened with old is bound to fresh instead (its client certificate
 * still counts), so a detached one resumes with the token the server now
 * asks for (and old, refused at the hello, resumes nothing). Returns how
 * many were rebound. */
int sv_resume_rebind(sv_server *srv, const char *old, const char *fresh);
/* Queues every kept reply after the hello reply of a resume. */
void sv_resume_push(sv_conn *c);
/* Keeps a waiting request's reply until acknowledged: a copy of the
 * frame buf (header and message; a small Read's bytes too) and one more
 * holder of bulk, the snapshot a large Read sends by reference (no copy
 * of its bytes; an in-place write after it copies the tensor instead,
 * charged to the writer). A reply that cannot be kept (over the session's
 * queue budget, out of memory) leaves an error reply for req_id in its
 * place, so a client that lost it with the socket hears why instead of
 * waiting for it. */
void sv_resume_keep(sv_session *s, uint64_t seq, uint64_t req_id,
                    const uint8_t *buf, size_t len, dsp_pin *bulk);
/* Forgets the kept replies up to seq ack. */
void sv_resume_ack(sv_session *s, uint64_t ack);
/* Queues the kept reply of seq again: 1, 0 when none is kept, or
 * DISPATCH_ENOMEM. */
int sv_resume_resend(sv_conn *c, uint64_t seq);
/* Drops the kept replies before a session's teardown job is submitted. */
void sv_resume_before_teardown(sv_session *s);
/* A job of a detached session came back (owner NULL): a waiting reply is
 * kept, a teardown frees the session. Returns the server. */
sv_server *sv_resume_done(sv_job *j);
/* An attached session was torn down: its resume state goes. */
void sv_resume_forget(sv_session *s);
/* Shutdown: every detached session is freed now. */
void sv_resume_shutdown(sv_server *srv);
/* A new session (c's hello) needs a slot: while the connections not
 * closing and the detached sessions together pass --max-sessions, a
 * detached session is expired to make room, those whose connection the
 * server closed for a limit first, then the one detached longest ago.
 * Returns the sessions held with c's counted: over --max-sessions only
 * when the connections alone are. */
int sv_resume_make_room(sv_conn *c);

/* transport.c: SHA-256 of the client certificate (DER), zeros when the
 * connection has none. */
void sv_transport_peer_digest(sv_conn *c, uint8_t out[32]);

/* net.c */
void sv_conn_close(sv_conn *c, const char *reason);
/* Starts (or restarts) reading the socket through the transport. */
void sv_conn_read_start(sv_conn *c);
/* The idle timer restarts: a request completed or a reply left. */
void sv_conn_touch(sv_conn *c);
/* Runs a decoded request: on the loop when it may, else on the pool. */
void sv_conn_dispatch(sv_conn *c, sv_job *j);
void sv_conn_submit(sv_conn *c, sv_job *j);
void sv_conn_on_done(sv_job *j, void *ud);
/* While the server drains: the goodbye frame and a close, once the
 * session has no request queued or running. */
void sv_conn_goodbye(sv_conn *c);

/* writer.c */
/* Queues one frame, taking buf and the pin (NULL, or a Read's bytes that
 * complete the frame). Over the output limit the client is dropped. */
void sv_writer_queue(sv_conn *c, uint8_t *buf, size_t len, dsp_pin *bulk);
/* Nothing left to send: no write in flight, no frame queued. */
int sv_writer_idle(const sv_conn *c);
/* Drops the frames not yet handed to the socket. */
void sv_writer_clear(sv_conn *c);
/* The next piece of the head frame: p/n, at most max bytes; 0 when the
 * queue is empty. sv_writer_consume then takes n bytes off the head. */
int sv_writer_peek(sv_conn *c, size_t max, const uint8_t **p, size_t *n);
void sv_writer_consume(sv_conn *c, size_t n);
/* Writes raw bytes (owned, freed when written) to the socket: at once as
 * far as it takes them unless queued, the rest through uv_write. */
void sv_writer_raw(sv_conn *c, uint8_t *buf, size_t len, int queued);
/* Hands bufs to the socket: try_write first unless queued, the rest
 * through uv_write. owned NULL: the bufs point into queued frames; the
 * caller consumes the bytes taken at once (the return value) and on_write
 * consumes the rest, so those frames stay until then. owned set: the bufs
 * are that one buffer, freed when written. <0 after closing the
 * connection. */
long sv_writer_sock(sv_conn *c, uv_buf_t *b, unsigned nb, uint8_t *owned,
                    int queued);
/* Sends an Error frame and closes the connection once it is written. */
void sv_refuse(sv_conn *c, uint64_t req_id, int code, const char *msg);
void sv_proto_error(sv_conn *c, uint64_t req_id, int code, const char *fmt,
                    ...) __attribute__((format(printf, 4, 5)));

/* reader.c */
/* Parses n plaintext bytes from p. */
void sv_reader_parse(sv_conn *c, const uint8_t *p, size_t n);
/* Where an upload's bulk lands next (NULL: none, read into rbuf), with at
 * most *room bytes. */
uint8_t *sv_reader_bulk_dst(sv_conn *c, size_t *room);
/* n bytes were read straight into bulk_dst. */
void sv_reader_bulk_got(sv_conn *c, size_t n);
/* 1 while the reader takes input (not paused, waiting or dead). */
int sv_reader_open(const sv_conn *c);
/* Starts reading again after a pause or a wait. */
void sv_reader_again(sv_conn *c);
/* The FIFO ran empty with an upload waiting on its quota. */
void sv_reader_resume_wait(sv_conn *c);
/* Stops reading for good. */
void sv_reader_stop(sv_conn *c);
/* Runs the frame timer while a frame is arriving and the peer, not the
 * server, holds it up: stopped while reading is paused or an upload waits
 * for its quota, restarted (whole) when reading resumes. */
void sv_reader_frame_timer(sv_conn *c);

/* hello.c */
void sv_hello(sv_conn *c, Dspwire__Request *req);

/* keepalive.c (1.4) */
/* The keepalive timer handle of a new connection (not started). */
void sv_keepalive_init(sv_conn *c);
/* Sets the keepalive interval the client asked for (ms; 0 stops it),
 * raised to the server's floor; returns the interval used. */
uint32_t sv_keepalive_set(sv_conn *c, uint32_t ms);
/* Closes the timer handle with the connection's other handles. */
void sv_keepalive_close(sv_conn *c, uv_close_cb cb);

/* metrics.c */
/* Starts the --metrics-listen endpoint (its own thread); 0, or a negative
 * code after logging why. Call once the devices are open. */
int sv_metrics_start(sv_server *srv);
/* Prints "dispatch-server metrics on IP:PORT" on stdout (after the
 * listening line, which scripts read first); nothing when off. */
void sv_metrics_announce(sv_server *srv);
/* Loop thread, at shutdown: closes the handle the endpoint wakes the loop
 * with (scrapes from now on get the last snapshot). */
void sv_metrics_loop_close(sv_server *srv);
/* After the loop ended: stops the endpoint's thread and frees it. */
void sv_metrics_stop(sv_server *srv);
/* A request of body case bc took ns from decode to its result (loop). */
void sv_metrics_observe(sv_server *srv, int bc, uint64_t ns);
/* SIGHUP (loop): /metrics wants token (len bytes, dsp_malloc'd) from now
 * on; takes it over (freed here when the endpoint is off) and wipes the
 * one it replaces. */
void sv_metrics_set_token(sv_server *srv, char *token, size_t len);

/* reload.c: SIGHUP rereads --token-file, --metrics-token-file and the
 * --tls-* files; each one that cannot be used is refused and the one in
 * use kept. */
/* Copies --token-file's token for the hellos: 0 or DISPATCH_ENOMEM. */
int sv_reload_start(sv_server *srv);
/* Starts the SIGHUP handle (loop thread, before the port is announced). */
void sv_reload_listen(sv_server *srv);
/* Closes the SIGHUP handle (shutdown: the loop then ends). */
void sv_reload_close(sv_server *srv);
/* After the loop ended: wipes the token. */
void sv_reload_free(sv_server *srv);

#endif
