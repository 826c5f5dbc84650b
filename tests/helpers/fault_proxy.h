/* Test helper: a fault-injection TCP proxy on 127.0.0.1 (libuv, its own
 * thread) between a client and a dispatch-server.
 *
 * It copies bytes both ways and follows the frames in each direction
 * (16-byte header, message, bulk; the message decoded as a Request from
 * the client, a Reply from the server), so a fault can be placed at a
 * byte offset of the stream, at a point inside the n-th frame of a kind
 * (the middle of an upload's bulk, just after a Backward, inside a Read
 * reply's tensor bytes), or at a time after the connection opened.
 *
 * Faults: CUT closes both sockets (FIN), RESET closes both with SO_LINGER
 * 0 (RST), DELAY holds that direction for arg ms, THROTTLE lets that
 * direction through at arg bytes per second from then on. Each rule
 * applies to one accepted connection (0 the first, 1 the second, ...,
 * -1 every one) and fires at most once per connection. */
#ifndef FAULT_PROXY_H
#define FAULT_PROXY_H

#include <stddef.h>
#include <stdint.h>

typedef enum { FP_C2S = 0, FP_S2C = 1 } fp_dir;
typedef enum { FP_CUT, FP_RESET, FP_DELAY, FP_THROTTLE } fp_action;

typedef struct fp_rule {
  int conn;          /* connection index, -1: every connection */
  fp_dir dir;        /* the direction whose bytes place the fault */
  /* where, one of: */
  int64_t at_byte;   /* >= 0: after this many bytes of dir */
  int body;          /* > 0: the frame whose Request (C2S) or Reply (S2C)
                        body case is this (DSPWIRE__*__BODY_*; for a reply
                        with no body use FP_EMPTY_REPLY) */
  int nth;           /* ... the nth such frame of the connection (1..) */
  int pct;           /* ... after its message and pct % of its bulk (100:
                        the frame's end) */
  int64_t at_ms;     /* > 0 (with at_byte < 0 and body 0): this long after
                        the connection opened */
  fp_action action;
  int64_t arg;       /* DELAY: ms; THROTTLE: bytes per second */
} fp_rule;

#define FP_EMPTY_REPLY 1000 /* a reply without body (Backward, Sync) */
#define FP_MAX_RULES 32

typedef struct fault_proxy fault_proxy;

/* Listens on 127.0.0.1 (ephemeral port) and forwards to
 * 127.0.0.1:server_port; NULL when it cannot start. rules are copied. */
fault_proxy *fp_start(int server_port, const fp_rule *rules, int n);
int fp_port(const fault_proxy *p);
/* Faults fired so far, and connections accepted. */
int fp_fired(fault_proxy *p);
int fp_conns(fault_proxy *p);
/* Where fault i fired, in words ("conn 2: cut c2s at byte 5120, inside
 * frame 7 (upload), bulk byte 2048 of 4096"); "" when out of range. */
void fp_where(fault_proxy *p, int i, char *buf, size_t len);
/* Stops the thread, closes everything, frees p. */
void fp_stop(fault_proxy *p);

#endif
