/* Test helper: one HTTP/1.0 request to 127.0.0.1:port over a plain
 * socket, for the metrics endpoint's tests. */
#ifndef TEST_HTTP_H
#define TEST_HTTP_H

#include <stddef.h>

/* Sends "METHOD PATH HTTP/1.0" and reads the answer to its end (HTTP/1.0:
 * the server closes after it), each read waiting at most a minute (a
 * safety net against a hung server, not a timing check). Returns the
 * status code with the body, a malloc'd string the caller frees, in
 * *body; or -1 (connect, I/O, a minute of silence or a malformed answer)
 * with *body NULL and what failed in why[0..why_len-1]. Never fails the
 * test itself. */
int http_request(int port, const char *method, const char *path,
                 char **body, char *why, size_t why_len);

/* The same with extra header lines (each ending in "\r\n", e.g.
 * "Authorization: Bearer T\r\n"); headers NULL: none. */
int http_request_hdr(int port, const char *method, const char *path,
                     const char *headers, char **body, char *why,
                     size_t why_len);

#endif
