/* The one table of request kinds: which requests wait for a reply and
 * which the loop may answer itself. Adding a request kind means adding a
 * row here, not finding the lists that name kinds. */
#include "sv.h"

#define ROW(bc, nm, w, l, b) [bc] = {nm, w, l, b}

static const sv_req_kind g_kinds[] = {
    ROW(DSPWIRE__REQUEST__BODY__NOT_SET, "empty", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_HELLO, "hello", 1, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_UPLOAD, "upload", 0, 0, 1),
    ROW(DSPWIRE__REQUEST__BODY_OP, "op", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_TRACK, "track", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_BACKWARD, "backward", 1, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_GRAD, "grad", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_STEP, "step", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_TO_DEVICE, "to_device", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_FREE, "free", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_READ, "read", 1, 1, 0),
    ROW(DSPWIRE__REQUEST__BODY_SYNC, "sync", 1, 1, 0),
    ROW(DSPWIRE__REQUEST__BODY_STATS, "stats", 1, 1, 0),
    ROW(DSPWIRE__REQUEST__BODY_BYE, "bye", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_GRAPH_DEFINE, "graph_define", 0, 0, 0),
    ROW(DSPWIRE__REQUEST__BODY_GRAPH_REPLAY, "graph_replay", 1, 0, 1),
    ROW(DSPWIRE__REQUEST__BODY_OPS, "ops", 0, 0, 0),
};

const sv_req_kind *sv_req_kind_of(Dspwire__Request__BodyCase bc) {
  static const sv_req_kind none = {"unknown", 0, 0, 0};
  size_t i = (size_t)bc;
  if (i >= sizeof g_kinds / sizeof g_kinds[0] || !g_kinds[i].name)
    return &none;
  return &g_kinds[i];
}

int sv_req_waits(const Dspwire__Request *r) {
  if (r->body_case == DSPWIRE__REQUEST__BODY_BACKWARD && r->backward &&
      r->backward->no_reply)
    return 0;
  return sv_req_kind_of(r->body_case)->waits;
}
