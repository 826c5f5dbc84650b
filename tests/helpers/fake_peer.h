/* Test helper: the socket side of a scripted fake server, for suites that
 * check what libdispatch-client puts on the wire (test_client_wire,
 * test_op_records). The script itself (which requests it answers, what it
 * logs) stays in each suite. */
#ifndef FAKE_PEER_H
#define FAKE_PEER_H

#include <stddef.h>

#include "dispatch.pb-c.h"

/* A listening socket on 127.0.0.1 with an ephemeral port (*port); -1 when
 * it cannot bind or listen. */
int fake_listen(int *port);
/* Reads exactly n bytes: 0, or -1 when the peer closed or failed. */
int fake_recv_n(int fd, void *p, size_t n);
/* Reads one request frame: 0 with *req (dspwire__request__free_unpacked
 * with a NULL allocator) and its bulk in *bulk (malloc'd, the caller
 * frees it; never NULL) of *bulk_len bytes; -1 when the peer closed or
 * sent something that is not a frame of a Request. */
int fake_recv_request(int fd, Dspwire__Request **req, void **bulk,
                      size_t *bulk_len);
/* Sends one reply frame (header, packed r, bulk_len bytes of bulk); a
 * failed send is ignored (the client under test notices). */
void fake_send_reply(int fd, const Dspwire__Reply *r, const void *bulk,
                     size_t bulk_len);

#endif
