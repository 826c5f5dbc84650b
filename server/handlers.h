/* Between the session (session.c: lifecycle, id tables, deferred errors),
 * its request handlers (handlers.c) and the kinds table that names them
 * (kinds.c). Worker side: everything here touches a session's tables, so
 * it runs only where sv_session_exec may (a worker, or the loop while the
 * session is idle). Every function that fails fills why[0..len-1] with
 * the reason (sv_why) and returns the code. */
#ifndef SV_HANDLERS_H
#define SV_HANDLERS_H

#include "sv.h"

/* The reason buffer sv_session_exec gives a handler. */
#define SV_WHY_LEN 512

/* What an id costs beside its tensor: the entry and its share of the id
 * map (two 16-byte slots at the map's lowest load). */
#define SV_ID_COST (DSP_BUDGET_COST(sizeof(sv_entry)) + 32)

/* ------------------------------------------------------------ id tables */

/* What names an id in an error message ("add: input 1", "step sgd: state
 * 0 of param 2"): kept as its parts and formatted only when the lookup
 * fails, so a successful op formats nothing (formatting a label for every
 * input of every op was ~4% of the server's time on a chain of small
 * ops). */
typedef enum {
  SV_LBL_PLAIN,
  SV_LBL_INPUT,
  SV_LBL_PARAM,
  SV_LBL_STATE
} sv_label_kind;
typedef struct sv_label {
  sv_label_kind kind;
  const char *name; /* the whole label (SV_LBL_PLAIN), or the op's name */
  size_t i, q;      /* input or param index; state index */
} sv_label;
#define SV_LABEL(text) ((sv_label){SV_LBL_PLAIN, (text), 0, 0})

/* The live tensor of id: DISPATCH_ENOID when unknown, DISPATCH_EPOISONED
 * (naming the failure that poisoned it) when poisoned. */
int sv_get_tensor(sv_session *s, uint64_t id, sv_label what, char *why,
                  size_t len, dsp_tensor **t);
/* DISPATCH_EIDINUSE when id names a tensor or a poisoned id. */
int sv_check_free_id(sv_session *s, uint64_t id, char *why, size_t len);
/* Inserts t under a free id, taking the caller's reference (dropped on
 * failure: DISPATCH_EQUOTA, DISPATCH_ENOMEM). */
int sv_insert(sv_session *s, uint64_t id, dsp_tensor *t, char *why,
              size_t len);
/* Removes id (a tensor or a poisoned id) and frees its entry; -1 when
 * the session has no such id. */
int sv_tensor_drop(sv_session *s, uint64_t id);
/* The gradient container of id: DISPATCH_ENOID, or DISPATCH_EPOISONED
 * for the id of a no-reply Backward that failed. */
int sv_get_grads(sv_session *s, uint64_t id, char *why, size_t len,
                 dsp_grads **g);
/* A no-reply Backward failed: its id becomes a failed container, charged
 * like a real one, so a later Grad or Step on it fails with
 * DISPATCH_EPOISONED and the client's Free of it succeeds. Out of quota
 * or memory the id stays unknown (those fail with DISPATCH_ENOID). */
void sv_grads_failed(sv_session *s, uint64_t id);
/* Removes gradients id and frees its container; -1 when unknown. */
int sv_grads_drop(sv_session *s, uint64_t id);

/* ------------------------------------------------------------ errors */

/* A failed request without a reply (an Op, or one record of an Ops): its
 * output, if it has one (has_out), is poisoned and the failure becomes
 * the session's deferred error unless one is pending. desc describes the
 * request (sv_describe), pre_err is the job's (its budget refusal was
 * counted when it was read). */
void sv_fail_deferred(sv_session *s, int rc, int pre_err, uint64_t req_id,
                      const char *desc, const char *why, int has_out,
                      uint64_t out_id);

/* ------------------------------------------------------------ handlers
 * The exec of each kind (sv_req_kind.exec; GraphDefine and GraphReplay
 * are graph.c's). 0, or a negative code with the reason in why. */
int sv_exec_upload(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_op(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_ops(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_to_device(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_track(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_backward(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_grad(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_step(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_free(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_read(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_sync(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_stats(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_bye(sv_session *s, sv_job *j, char *why, size_t len);
/* checkpoint.c: CkptSave and CkptLoad (1.6) in --checkpoint-dir */
int sv_exec_ckpt_save(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_ckpt_load(sv_session *s, sv_job *j, char *why, size_t len);
/* peer.c: server-to-server transfers (1.7) */
int sv_exec_peer_grant(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_peer_pull(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_peer_fetch(sv_session *s, sv_job *j, char *why, size_t len);
/* Revokes the capabilities of s's tensor id (0: all of s's), on a Free
 * and at the session's end; any thread. */
void sv_peer_revoke(const sv_session *s, uint64_t id);
/* The credentials pulls present to peers (reload.c calls these on the
 * loop thread; the pulls read them on workers). sv_peer_creds_start:
 * --peer-token-file's token and the --peer-ca/--peer-cert/--peer-key TLS
 * context from cfg, 0 or a code with why. sv_peer_set_token takes tok
 * (dsp_malloc'd, NULL: none) for the next pulls and frees the old one.
 * sv_peer_reload_tls builds a new context from the files: 0, or -1 with
 * why and the old one kept. sv_peer_creds_free drops both. */
int sv_peer_creds_start(const sv_config *cfg, char *why, size_t len);
void sv_peer_set_token(char *tok, size_t len);
int sv_peer_reload_tls(const sv_config *cfg, char *why, size_t len);
void sv_peer_creds_free(void);

#endif
