/* The MPI group of dispatch-server --mpi (group.c, protocol 1.7). */
#ifndef SV_GROUP_H
#define SV_GROUP_H

#include "sv.h"

/* Under --mpi, before sv_run: loads the MPI plugin, starts the group
 * thread (MPI_Init_thread), applies the trust rule and moves cfg's port to
 * --listen's + rank. 0, or a negative code with the reason on stderr. */
int sv_group_start(sv_config *cfg);
/* After sv_run: stops the group thread (rank 0 tells the others) and ends
 * MPI; nothing when no group was started. */
void sv_group_stop(void);

/* On a worker: all-reduces ts[0..n-1] (one dtype) in place through the
 * group, its host copy charged to budget (the session's) while held, as (group, seq) with reduce 0 (sum) or 1 (mean), waiting at most
 * 3 x --mpi-timeout. 0, or a negative code (DISPATCH_EGROUP: a member
 * disagreed, lacked the request, failed or timed out) with why. */
int sv_group_reduce(dsp_ctx *ctx, dsp_budget *budget, dsp_tensor *const *ts,
                    size_t n, uint64_t group, uint64_t seq, int reduce,
                    char *why, size_t len);
/* Where one rank holds the tensors of an all-reduce, in the header every
 * rank sends before the data: kind SV_GK_CUDA when all of them live on
 * one CUDA backend (dev its ordinal), else SV_GK_HOST; nccl 1 when the
 * rank loaded the NCCL plugin. */
enum { SV_GK_HOST = 0, SV_GK_CUDA = 1 };
typedef struct sv_gplace {
  int64_t kind, dev, nccl;
} sv_gplace;
/* The path of one all-reduce from the n members' places: 1 (NCCL on the
 * GPUs) when every member holds its tensors on CUDA and has NCCL, else 0
 * (host memory and MPI_Allreduce; CUDA tensors are staged through the
 * host). Depends on the places only, so every rank chooses alike. */
int sv_group_nccl_path(const sv_gplace *p, int n);

/* A GroupAllreduce's reduction in words ("sum", "mean", "broadcast from
 * rank R") into buf; returns buf. */
const char *sv_group_reduce_name(int64_t reduce, char *buf, size_t len);

/* The kinds' handlers (kinds.c) */
int sv_exec_group_join(sv_session *s, sv_job *j, char *why, size_t len);
int sv_exec_group_allreduce(sv_session *s, sv_job *j, char *why, size_t len);
/* A grouped Step (st->group set): the gradients args[i * stride + 1] of
 * its n params, all-reduced before the update. */
int sv_group_step_grads(sv_session *s, dsp_tensor *const *args, size_t n,
                        size_t stride, const Dspwire__Step *st, char *why,
                        size_t len);

#endif
