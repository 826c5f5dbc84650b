/* SIGHUP: the files an operator rotates are read again without a restart:
 * --token-file (the token a hello must present), --metrics-token-file,
 * --tls-cert / --tls-key (with --tls-client-ca) into a new TLS context,
 * and what this server presents to its peers: --peer-token-file and
 * --peer-ca / --peer-cert / --peer-key (peer.c). What is taken applies to
 * new connections, scrapes and pulls only: a connection already made (a
 * pull in flight included) keeps its TLS session and its session,
 * whatever changed. Each file that cannot be used (missing, unreadable, an empty
 * token, a key that does not match the certificate) is refused on its
 * own: the one in use stays, and the log says which and why. A detached
 * session opened with the old token is bound to the new one, so it
 * resumes with the token the server now asks for (resume.c).
 *
 * Everything here runs on the loop thread, as the hellos and the TLS
 * accepts that read what it replaces; nothing here stops the server. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "conn.h"
#include "handlers.h"

/* One refused file: logged, counted by the caller. */
static void refused(const char *opt, const char *why, const char *kept) {
  sv_log(SV_LOG_WARN, "reload (SIGHUP): refused %s: %s; %s", opt, why, kept);
}

/* Reads path into a fresh token: 0 with *tok, -1 after logging why. */
static int read_token(const char *opt, const char *path, char **tok,
                      size_t *len) {
  char why[600];
  if (sv_secret_read(path, tok, len, why, sizeof why) == 0) return 0;
  refused(opt, why, "the token in use stays");
  return -1;
}

/* --token-file: the hellos' token is replaced, and the sessions opened
 * with the old one are bound to the new one. 0 taken, -1 refused. */
static int reload_token(sv_server *srv) {
  char *tok;
  size_t len;
  if (read_token("--token-file", srv->cfg->token_file, &tok, &len) < 0)
    return -1;
  int n = sv_resume_rebind(srv, srv->token, tok);
  sv_secret_free(&srv->token, &srv->token_len);
  srv->token = tok;
  srv->token_len = len;
  sv_log(SV_LOG_INFO,
         "reload (SIGHUP): token reloaded from --token-file %s: new "
         "connections must present it (%d resumable sessions rebound to "
         "it, connected ones go on)",
         srv->cfg->token_file, n);
  return 0;
}

static int reload_metrics_token(sv_server *srv) {
  char *tok;
  size_t len;
  const char *path = srv->cfg->metrics_token_file;
  if (read_token("--metrics-token-file", path, &tok, &len) < 0) return -1;
  sv_metrics_set_token(srv, tok, len);
  sv_log(SV_LOG_INFO,
         "reload (SIGHUP): metrics token reloaded from "
         "--metrics-token-file %s",
         path);
  return 0;
}

static int reload_tls(sv_server *srv) {
  const sv_config *cfg = srv->cfg;
  char why[1024];
  if (sv_tls_ctx_reload(srv->tls, cfg, why, sizeof why) < 0) {
    refused("the TLS files", why,
            "the certificate and key in use stay (no file of them is "
            "taken)");
    return -1;
  }
  sv_log(SV_LOG_INFO,
         "reload (SIGHUP): TLS certificate and key reloaded from "
         "--tls-cert %s, --tls-key %s%s%s: new connections use them, "
         "connected ones go on",
         cfg->tls_cert, cfg->tls_key,
         cfg->tls_client_ca ? ", --tls-client-ca " : "",
         cfg->tls_client_ca ? cfg->tls_client_ca : "");
  return 0;
}

/* --peer-token-file: the token the next pulls send to their peers. */
static int reload_peer_token(sv_server *srv) {
  char *tok;
  size_t len;
  const char *path = srv->cfg->peer_token_file;
  if (read_token("--peer-token-file", path, &tok, &len) < 0) return -1;
  sv_peer_set_token(tok, len);
  sv_log(SV_LOG_INFO,
         "reload (SIGHUP): peer token reloaded from --peer-token-file %s: "
         "the next pulls present it (pulls in flight go on)",
         path);
  return 0;
}

/* --peer-ca (with --peer-cert/--peer-key): a new TLS client context for
 * the next pulls. */
static int reload_peer_tls(sv_server *srv) {
  char why[1024];
  if (sv_peer_reload_tls(srv->cfg, why, sizeof why) < 0) {
    refused("the --peer-ca/--peer-cert/--peer-key files", why,
            "the peer TLS files in use stay (no file of them is taken)");
    return -1;
  }
  sv_log(SV_LOG_INFO,
         "reload (SIGHUP): peer TLS files reloaded (--peer-ca %s%s%s): the "
         "next pulls use them",
         srv->cfg->peer_ca, srv->cfg->peer_cert ? ", --peer-cert " : "",
         srv->cfg->peer_cert ? srv->cfg->peer_cert : "");
  return 0;
}

static void on_sighup(uv_signal_t *h, int signum) {
  sv_server *srv = h->data;
  const sv_config *cfg = srv->cfg;
  (void)signum;
  int n = 0, bad = 0;
  if (cfg->token_file) n++, bad += reload_token(srv) < 0;
  if (cfg->metrics_token_file) n++, bad += reload_metrics_token(srv) < 0;
  if (srv->tls) n++, bad += reload_tls(srv) < 0;
  if (cfg->peer_token_file) n++, bad += reload_peer_token(srv) < 0;
  if (cfg->peer_ca) n++, bad += reload_peer_tls(srv) < 0;
  if (n == 0) {
    sv_log(SV_LOG_INFO, "reload (SIGHUP): nothing to reload (no "
                        "--token-file, --metrics-token-file, --tls-cert, "
                        "--peer-token-file or --peer-ca)");
    return;
  }
  atomic_fetch_add_explicit(&srv->g.m.reloads[bad ? 1 : 0], 1,
                            memory_order_relaxed);
  sv_log(bad ? SV_LOG_WARN : SV_LOG_INFO,
         "reload (SIGHUP): done: %d reloaded, %d refused", n - bad, bad);
}

/* Prints why the server cannot start (main prints nothing more). */
static int start_failed(int rc, const char *why) {
  fprintf(stderr, "dispatch-server: %s\n", why);
  sv_start_reason_printed = 1;
  return rc;
}

int sv_reload_start(sv_server *srv) {
  const sv_config *cfg = srv->cfg;
  char why[1024];
  if (cfg->token) {
    srv->token = dsp_malloc(cfg->token_len + 1);
    if (!srv->token) return start_failed(DISPATCH_ENOMEM,
                                         "out of memory for the token");
    memcpy(srv->token, cfg->token, cfg->token_len + 1);
    srv->token_len = cfg->token_len;
  }
  /* a bad --peer-ca/--peer-cert/--peer-key stops the server here, as a
   * bad --tls-cert does, rather than failing every pull later */
  int rc = sv_peer_creds_start(cfg, why, sizeof why);
  if (rc < 0) {
    sv_secret_free(&srv->token, &srv->token_len);
    return start_failed(rc, why);
  }
  return 0;
}

void sv_reload_listen(sv_server *srv) {
  uv_signal_init(&srv->loop, &srv->sighup);
  srv->sighup.data = srv;
  srv->sighup_open = 1;
  uv_signal_start(&srv->sighup, on_sighup, SIGHUP);
}

void sv_reload_close(sv_server *srv) {
  if (!srv->sighup_open) return;
  srv->sighup_open = 0;
  uv_close((uv_handle_t *)&srv->sighup, NULL);
}

void sv_reload_free(sv_server *srv) {
  sv_secret_free(&srv->token, &srv->token_len);
  sv_peer_creds_free();
}
