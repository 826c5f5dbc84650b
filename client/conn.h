/* Internal to the wire side of a REMOTE device: the transport table and
 * what its files share. conn.c is the connection (socket, plain TCP row,
 * how a connection fails), tls.c the TLS row, call.c the send buffer and
 * the reply wait, replay.c the replay log and resume, remote.c the
 * requests and the REMOTE row of the device-kind table. */
#ifndef DISPATCH_CLIENT_CONN_H
#define DISPATCH_CLIENT_CONN_H

#include "client_internal.h"
#include "dispatch.pb-c.h"

#define DISPATCH__MAX_REPLY_MSG (64u << 20)
/* Internal: the socket is gone but the session may be resumed. Never
 * returned to a caller. */
#define DISPATCH__EBROKEN (-1000)

/* How bytes move over a connected socket: plain TCP (conn.c) or TLS
 * (tls.c), chosen at open (dispatch__conn.tr); the rest of the library
 * never asks which one it has. Failures lose the connection
 * (dispatch__conn_lost) and return its code. */
typedef struct dispatch__transport {
  const char *name;
  /* after each connect (open and every reconnect): TCP its receive
   * buffer, TLS the handshake with the options of tls */
  int (*open)(dispatch_device *dev, const char *host,
              const dispatch_options *tls);
  /* all n bytes, within the timeout (with keepalives: of silence) */
  int (*write)(dispatch_device *dev, const void *p, size_t n);
  /* exactly n bytes; wait_first: poll before the first read (a reply
   * that cannot be there yet); boundary: p is a frame's start, where the
   * deadline may end the wait with DISPATCH_ETIMEDOUT (keepalives) */
  int (*read)(dispatch_device *dev, void *p, size_t n, int64_t deadline,
              int wait_first, int boundary);
  /* copies up to cap bytes that came and were not read yet (a going-away
   * frame behind a failed send); 0 when it cannot tell */
  size_t (*unread)(dispatch__conn *c, uint8_t *buf, size_t cap);
  /* frees the transport's state (TLS: a close_notify first while the
   * socket is open) */
  void (*close)(dispatch__conn *c);
} dispatch__transport;
DISPATCH__HIDDEN extern const dispatch__transport dispatch__transport_tcp;
DISPATCH__HIDDEN extern const dispatch__transport dispatch__transport_tls;

/* conn.c */
DISPATCH__HIDDEN int64_t dispatch__now_ms(void);
/* The deadline of a wait or send starting now: timeout_ms 0 is no bound. */
DISPATCH__HIDDEN int64_t dispatch__deadline_in(const dispatch__conn *c);
/* Connects within the timeout, then opens dev->conn->tr over the socket. */
DISPATCH__HIDDEN int dispatch__conn_open(dispatch_device *dev,
                                         const char *host, const char *port,
                                         const dispatch_options *tls);
/* Through the connection's transport (see dispatch__transport). */
DISPATCH__HIDDEN int dispatch__send_all(dispatch_device *dev, const void *p,
                                        size_t n);
DISPATCH__HIDDEN int dispatch__recv_all(dispatch_device *dev, void *p,
                                        size_t n, int64_t deadline,
                                        int wait_first, int boundary);
/* Closes the socket (and TLS session) and forgets bytes in flight. */
DISPATCH__HIDDEN void dispatch__drop_socket(dispatch__conn *c);
/* The connection is gone for good with code (conn_dead: ECONN). */
DISPATCH__HIDDEN int dispatch__conn_down(dispatch_device *dev, int code,
                                         const char *why);
DISPATCH__HIDDEN int dispatch__conn_dead(dispatch_device *dev,
                                         const char *why);
/* The socket failed: a shutdown when the server's goodbye waits unread,
 * DISPATCH__EBROKEN on a resumable session (the caller reconnects), else
 * dead. */
DISPATCH__HIDDEN int dispatch__conn_lost(dispatch_device *dev,
                                         const char *why);
/* A server that sends keepalives was silent for the whole timeout. */
DISPATCH__HIDDEN int dispatch__conn_silent(dispatch_device *dev);
/* 0, DISPATCH__EBROKEN (a reconnect is due) or the dead connection's code. */
DISPATCH__HIDDEN int dispatch__check_alive(dispatch_device *dev);

/* call.c */
DISPATCH__HIDDEN extern ProtobufCAllocator dispatch__pb_alloc;
/* Sends the queued frames (the open op batch first). */
DISPATCH__HIDDEN int dispatch__flush(dispatch_device *dev);
/* Appends one frame (header, message, bulk), logged when it has a seq. */
DISPATCH__HIDDEN int dispatch__put_frame(dispatch_device *dev,
                                         Dspwire__Request *req,
                                         const void *bulk, size_t bulk_len);
/* Reads frames until the reply to req_id (see call.c). */
DISPATCH__HIDDEN int dispatch__await_reply(dispatch_device *dev,
                                           uint64_t req_id, void *dst,
                                           size_t dst_len, uint64_t target,
                                           Dspwire__Reply **reply,
                                           int may_time_out);
/* Queues the batched frees, reconnecting when the socket went. */
DISPATCH__HIDDEN int dispatch__put_frees_now(dispatch_device *dev);
/* Sends req and waits for its reply; a Read's bulk lands in dst, target
 * is the tensor a failure of req itself poisons. */
DISPATCH__HIDDEN int dispatch__call(dispatch_device *dev,
                                    Dspwire__Request *req, void *dst,
                                    size_t dst_len, uint64_t target,
                                    Dspwire__Reply **reply);
/* Queues req (id rid, or a new one) with bulk; no reply is waited for. */
DISPATCH__HIDDEN int dispatch__queue(dispatch_device *dev,
                                     Dspwire__Request *req, uint64_t rid,
                                     const void *bulk, size_t bulk_len);
/* Queues one op as a record of the open Ops batch. */
DISPATCH__HIDDEN int dispatch__put_record(dispatch_device *dev, dsp_opcode op,
                                          const uint64_t *in, int n_in,
                                          const dsp_attrs *a, uint64_t out,
                                          int no_grad);

/* replay.c */
/* Appends one frame to the replay log; 0 or -1 when out of memory. */
DISPATCH__HIDDEN int dispatch__log_frame(dispatch__conn *c, uint64_t seq,
                                         const uint8_t *frame, size_t flen,
                                         const void *bulk, size_t bulk_len);
/* Forgets the logged frames up to seq: the server has received them. */
DISPATCH__HIDDEN void dispatch__log_trim(dispatch__conn *c, uint64_t seq);
/* Copies a large upload's bytes from the caller's buffer into the log. */
DISPATCH__HIDDEN void dispatch__log_take_ext(dispatch__conn *c);
/* Reconnects and resumes the session after the socket failed: 0, or the
 * code the connection is now dead with. */
DISPATCH__HIDDEN int dispatch__reconnect(dispatch_device *dev);
/* Keeps what a reconnect needs when the server offers resume. */
DISPATCH__HIDDEN int dispatch__setup_resume(dispatch_device *dev,
                                            const Dspwire__HelloReply *h,
                                            const char *host,
                                            const char *port,
                                            const char *token,
                                            const char *client_name,
                                            const dispatch_options *tls);

#endif
