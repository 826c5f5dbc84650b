/* Test helper: a one-connection TLS client proxy, so the raw-protocol
 * helpers of wire.h can speak to a TLS dispatch-server.
 *
 * tlsp_start listens on 127.0.0.1 (ephemeral port in p->port) and runs a
 * thread that accepts one plain connection, opens a TLS session to
 * 127.0.0.1:server_port (certificate verified against ca_file for name
 * "localhost"), and copies bytes both ways until either side closes; a
 * server close closes the plain side too, so wire_wait_closed sees it.
 * The proxy reads from the server only as fast as the plain client reads,
 * so a client that does not read holds the server's replies back as a
 * plain TCP client would. 0 or -1. tlsp_stop joins the thread. */
#ifndef TLS_PROXY_H
#define TLS_PROXY_H

#include <pthread.h>

typedef struct tlsp_proxy {
  int port;
  int lfd;
  int server_port;
  char ca[256];
  pthread_t th;
  int running;
} tlsp_proxy;

int tlsp_start(tlsp_proxy *p, int server_port, const char *ca_file);
void tlsp_stop(tlsp_proxy *p);

#endif
