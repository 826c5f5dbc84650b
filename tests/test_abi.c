/* The ABI contract of the public structs and the version (issue 13 item
 * 6): dispatch_stats and dispatch_options carry their size, and the
 * library reads or writes only the fields within it, so a program built
 * against an older, shorter struct neither has bytes past its struct
 * touched nor gets fields it never set read; a struct whose size was
 * never set is refused with a message; remote stats carry the server-wide
 * counters of the Stats reply; the version macros, dispatch_version() and
 * the Makefile's version agree. (What the shared library exports is
 * checked by tests/abi/check-exports.sh.) */
#include <criterion/criterion.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

static sp_server g_srv;
static char g_dir[64];
static char g_token_path[128];

static void need_server(const char *const *args) {
  check_server_start(&g_srv, args);
}

static void stop_server(void) {
  if (g_srv.pid) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
  if (g_token_path[0]) unlink(g_token_path);
  if (g_dir[0]) rmdir(g_dir);
}

static dispatch_device *open_spec(const char *spec,
                                  const dispatch_options *o) {
  dispatch_device *dev = NULL;
  char msg[256];
  int rc = dispatch_device_open(spec, o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s: %s", spec, dispatch_err_name(rc), msg);
  return dev;
}

static dispatch_tensor *one_tensor(dispatch_device *dev) {
  int64_t sh[1] = {256};
  dispatch_tensor *t = NULL;
  int rc = dispatch_ones(dev, DISPATCH_F32, 1, sh, &t);
  cr_assert_eq(rc, 0, "ones: %s", dispatch_device_errmsg(dev));
  return t;
}

/* The struct of a program built when dispatch_stats had five counters:
 * the library must fill those and leave every byte after them alone. */
Test(abi, stats_of_an_older_shorter_struct_stay_within_its_size) {
  dispatch_device *dev = open_spec("local", NULL);
  dispatch_tensor *t = one_tensor(dev);
  union {
    dispatch_stats st;
    unsigned char bytes[sizeof(dispatch_stats) + 64];
  } buf;
  memset(&buf, 0xAB, sizeof buf);
  size_t old = offsetof(dispatch_stats, grads) + sizeof(uint64_t);
  buf.st.size = old;
  cr_assert_eq(dispatch_device_stats(dev, &buf.st), 0, "%s",
               dispatch_device_errmsg(dev));
  cr_assert_eq(buf.st.size, old, "size was rewritten to %zu", buf.st.size);
  cr_assert_eq(buf.st.tensors, 1);
  cr_assert_eq(buf.st.bytes, 256 * sizeof(float));
  for (size_t i = old; i < sizeof buf.bytes; i++)
    cr_assert_eq(buf.bytes[i], 0xAB,
                 "byte %zu, past the caller's size %zu, was written (0x%02x)",
                 i, old, buf.bytes[i]);
  dispatch_tensor_free(t);
  dispatch_device_close(dev);
}

Test(abi, stats_with_no_size_is_refused_and_untouched) {
  dispatch_device *dev = open_spec("local", NULL);
  dispatch_stats st;
  memset(&st, 0, sizeof st);
  st.tensors = 77;
  int rc = dispatch_device_stats(dev, &st);
  cr_assert_eq(rc, DISPATCH_EINVAL, "got %s", dispatch_err_name(rc));
  cr_assert_eq(st.tensors, 77, "a refused call wrote into the struct");
  cr_assert_not_null(strstr(dispatch_device_errmsg(dev), "DISPATCH_STATS_INIT"),
                     "message: %s", dispatch_device_errmsg(dev));
  dispatch_device_close(dev);
}

Test(abi, local_stats_fill_every_field_of_the_current_struct) {
  dispatch_device *dev = open_spec("local", NULL);
  dispatch_stats st = DISPATCH_STATS_INIT;
  cr_assert_eq(st.size, sizeof(dispatch_stats));
  cr_assert_eq(dispatch_device_stats(dev, &st), 0);
  cr_assert_eq(st.size, sizeof(dispatch_stats));
  cr_assert_eq(st.devices, 1, "a local device is one in-process CPU");
  cr_assert_eq(st.sessions, 0, "no server behind a local device");
  dispatch_device_close(dev);
}

/* The server sends its server-wide counters in every Stats reply; the
 * public struct now carries them. Two sessions are open, so the
 * server-wide figures must cover both. */
Test(abi, remote_stats_carry_the_server_wide_counters,
     .fini = stop_server) {
  need_server(NULL);
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *a = open_spec(spec, NULL), *b = open_spec(spec, NULL);
  dispatch_tensor *ta = one_tensor(a), *tb = one_tensor(b);
  cr_assert_eq(dispatch_device_sync(b), 0); /* b's ones has run */
  dispatch_stats st = DISPATCH_STATS_INIT;
  cr_assert_eq(dispatch_device_stats(a, &st), 0, "%s",
               dispatch_device_errmsg(a));
  cr_assert_eq(st.tensors, 1);
  cr_assert_eq(st.bytes, 256 * sizeof(float));
  cr_assert_geq(st.sessions, 2, "sessions %llu", (unsigned long long)st.sessions);
  cr_assert_geq(st.server_tensors, 2);
  cr_assert_geq(st.server_bytes, 2 * 256 * sizeof(float));
  cr_assert_geq(st.held_bytes, st.bytes, "held %llu < bytes %llu",
                (unsigned long long)st.held_bytes,
                (unsigned long long)st.bytes);
  cr_assert_geq(st.server_held_bytes, st.held_bytes);
  /* the ones op ran in a worker's turn, or inline on the network thread */
  cr_assert_geq(st.batches + st.inline_ops, 1, "batches %llu, inline %llu",
                (unsigned long long)st.batches,
                (unsigned long long)st.inline_ops);
  cr_assert_geq(st.devices, 1);
  int n = 0;
  dispatch_device_info info[4] = {DISPATCH_DEVICE_INFO_INIT};
  cr_assert_eq(dispatch_device_list(a, info, 4, &n), 0);
  cr_assert_eq(st.devices, (uint64_t)n, "devices %llu, device_list %d",
               (unsigned long long)st.devices, n);
  dispatch_tensor_free(ta);
  dispatch_tensor_free(tb);
  dispatch_device_close(b);
  dispatch_device_close(a);
}

/* An options struct of a program built when it had only `size`: the
 * token the program's memory holds after that is not its field and must
 * not be read, so the server (which wants that token) refuses the hello;
 * with the size covering the token, the same bytes open the device. */
Test(abi, options_are_read_only_within_their_size, .fini = stop_server) {
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp-abi-XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
  snprintf(g_token_path, sizeof g_token_path, "%s/token", g_dir);
  FILE *f = fopen(g_token_path, "w");
  cr_assert_not_null(f);
  fputs("abi-token\n", f);
  cr_assert_eq(fclose(f), 0);
  const char *args[] = {"--token-file", g_token_path, NULL};
  need_server(args);
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  unsetenv("DISPATCH_TOKEN");

  dispatch_options o;
  dispatch_options_init(&o);
  cr_assert_eq(o.size, sizeof(dispatch_options));
  o.token = "abi-token";
  o.timeout_ms = 60000;
  dispatch_device *dev = open_spec(spec, &o);
  dispatch_device_close(dev);

  o.size = offsetof(dispatch_options, token);
  dev = NULL;
  char msg[256] = "";
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EAUTH,
               "a token past opts->size was read: %s (%s)",
               dispatch_err_name(rc), msg);
  cr_assert_null(dev);
}

Test(abi, options_with_no_size_are_refused) {
  dispatch_options o;
  memset(&o, 0, sizeof o);
  dispatch_device *dev = (dispatch_device *)&o; /* must become NULL */
  char msg[256] = "";
  int rc = dispatch_device_open("local", &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EINVAL, "got %s", dispatch_err_name(rc));
  cr_assert_null(dev);
  cr_assert_not_null(strstr(msg, "dispatch_options_init"), "message: %s", msg);
  /* the initialiser macro is the other way to start */
  dispatch_options m = DISPATCH_OPTIONS_INIT;
  rc = dispatch_device_open("local", &m, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s", msg);
  dispatch_device_close(dev);
}

/* One version: the header's numbers (dispatch_version.h), the string the
 * Makefile derived from them for the soname and the server
 * (DISPATCH_VERSION_STRING), and what the library reports. */
Test(abi, version_is_one_value_everywhere) {
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", DISPATCH_VERSION_MAJOR,
           DISPATCH_VERSION_MINOR, DISPATCH_VERSION_PATCH);
  cr_assert_str_eq(DISPATCH_VERSION, want);
  cr_assert_str_eq(dispatch_version(), want);
  cr_assert_str_eq(DISPATCH_VERSION_STRING, want);
  cr_assert_eq(DISPATCH_VERSION_HEX,
               (DISPATCH_VERSION_MAJOR << 16) | (DISPATCH_VERSION_MINOR << 8) |
                   DISPATCH_VERSION_PATCH);
}

/* An array of an older dispatch_device_info that ended before the memory
 * fields: walked with the caller's stride, each element gets kind, name
 * and description, and no byte past an element's size is written. */
Test(abi, device_list_walks_an_older_array_with_its_stride,
     .fini = stop_server) {
  const char *args[] = {"--device", "cpu:0", "--device", "cpu:1", NULL};
  need_server(args);
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = open_spec(spec, NULL);
  size_t old = offsetof(dispatch_device_info, total_memory);
  unsigned char buf[3 * sizeof(dispatch_device_info)];
  memset(buf, 0xAB, sizeof buf);
  dispatch_device_info first;
  memset(&first, 0, sizeof first);
  first.size = old;
  memcpy(buf, &first, sizeof first.size);
  int n = 0;
  cr_assert_eq(dispatch_device_list(dev, (dispatch_device_info *)buf, 2, &n),
               0, "%s", dispatch_device_errmsg(dev));
  cr_assert_eq(n, 2);
  for (int i = 0; i < 2; i++) {
    dispatch_device_info e;
    memset(&e, 0, sizeof e);
    memcpy(&e, buf + (size_t)i * old, old);
    char want[16];
    snprintf(want, sizeof want, "cpu:%d", i);
    cr_assert_eq(e.size, old, "element %d size %zu", i, e.size);
    cr_assert_str_eq(e.kind, "cpu");
    cr_assert_str_eq(e.name, want, "element %d is at the caller's stride", i);
  }
  for (size_t i = 2 * old; i < sizeof buf; i++)
    cr_assert_eq(buf[i], 0xAB, "byte %zu past the array (%zu bytes) written",
                 i, 2 * old);
  dispatch_device_close(dev);
}

Test(abi, device_list_with_no_size_is_refused) {
  dispatch_device *dev = open_spec("local", NULL);
  dispatch_device_info info[2];
  memset(info, 0, sizeof info);
  int n = -1;
  int rc = dispatch_device_list(dev, info, 2, &n);
  cr_assert_eq(rc, DISPATCH_EINVAL, "got %s", dispatch_err_name(rc));
  cr_assert_not_null(strstr(dispatch_device_errmsg(dev),
                            "DISPATCH_DEVICE_INFO_INIT"),
                     "message: %s", dispatch_device_errmsg(dev));
  dispatch_device_info ok[2] = {DISPATCH_DEVICE_INFO_INIT};
  cr_assert_eq(dispatch_device_list(dev, ok, 2, &n), 0);
  cr_assert_eq(n, 1);
  cr_assert_str_eq(ok[0].name, "local:cpu");
  cr_assert_eq(ok[0].size, sizeof(dispatch_device_info));
  dispatch_device_close(dev);
}
