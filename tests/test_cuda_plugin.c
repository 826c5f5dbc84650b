/* The CUDA backend as a plugin (common/cuda_plugin.h), without a GPU:
 * dispatch-server and libdispatch-client carry no CUDA library, and a
 * CUDA device asked for says which of the two is missing, the plugin
 * (naming where it was looked for) or the GPU and driver (naming the
 * plugin that did load), both in process (local:cuda:0) and in the server
 * (--device cuda:0); a stale plugin or a file that is not one is refused.
 * On a host with a GPU the open succeeds and that is checked instead. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/server_proc.h"
#include "helpers/client_check.h"

/* readelf -d's NEEDED lines of file into out; asserts readelf ran. */
static void needed_of(const char *file, char *out, size_t len) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "readelf -d '%s' 2>&1 | grep NEEDED", file);
  FILE *p = popen(cmd, "r");
  cr_assert_not_null(p);
  size_t got = fread(out, 1, len - 1, p);
  out[got] = '\0';
  pclose(p);
  cr_assert(strstr(out, "libc.so"), "readelf -d %s: %s", file, out);
}

Test(cuda_plugin, server_and_library_link_no_cuda_library) {
  char lib[4096], out[8192];
  const char *files[2] = {check_server_bin(), lib};
  beside_server("libdispatch-client.so", lib, sizeof lib);
  for (int i = 0; i < 2; i++) {
    needed_of(files[i], out, sizeof out);
    cr_assert_null(strstr(out, "libcuda"), "%s needs %s", files[i], out);
    cr_assert_null(strstr(out, "libcublas"), "%s needs %s", files[i], out);
    cr_assert_null(strstr(out, "libstdc++"), "%s needs %s", files[i], out);
  }
#if DSP_CUDA_BUILT
  /* the same check sees CUDA where it is: in the plugin */
  char plugin[4096];
  beside_server("dispatch-cuda.so", plugin, sizeof plugin);
  needed_of(plugin, out, sizeof out);
  cr_assert(strstr(out, "libcudart") && strstr(out, "libcublas"), "%s", out);
#endif
}

/* local:cuda:0 with DISPATCH_CUDA_PLUGIN=plugin: its code; on failure no
 * device and the message in msg, on success the device in *dev. */
static int open_with(const char *plugin, dispatch_device **dev, char *msg,
                     size_t len) {
  setenv("DISPATCH_CUDA_PLUGIN", plugin, 1);
  *dev = NULL;
  int rc = dispatch_device_open("local:cuda:0", NULL, dev, msg, len);
  if (rc < 0) cr_assert_null(*dev);
  return rc;
}

Test(cuda_plugin, local_cuda_without_the_plugin_names_where_it_looked) {
  dispatch_device *dev;
  char msg[2048];
  int rc = open_with("/nonexistent/dispatch-cuda.so", &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s: %s", dispatch_err_name(rc),
               msg);
  cr_assert(strstr(msg, "device \"local:cuda:0\": CUDA plugin not found") &&
                strstr(msg, "/nonexistent/dispatch-cuda.so"),
            "%s", msg);
  cr_assert_null(strstr(msg, "built without"), "%s", msg);
}

/* Without the variable the loader looks beside this program: a test of
 * build/tests/ has no plugin there, and the message lists each place. */
Test(cuda_plugin, the_search_order_is_in_the_message) {
  unsetenv("DISPATCH_CUDA_PLUGIN");
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  cr_assert_gt(n, 0);
  exe[n] = '\0';
  *strrchr(exe, '/') = '\0';
  char want[3][4300];
  snprintf(want[0], sizeof want[0], "looked for %s/dispatch-cuda.so, ", exe);
  snprintf(want[1], sizeof want[1], "%s/dispatch/dispatch-cuda.so, ", exe);
  snprintf(want[2], sizeof want[2], "%s/../lib/dispatch/dispatch-cuda.so;",
           exe);
  dispatch_device *dev = NULL;
  char msg[2048];
  int rc = dispatch_device_open("local:cuda", NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s", msg);
  for (int i = 0; i < 3; i++) cr_assert(strstr(msg, want[i]), "%s: %s", want[i], msg);
  cr_assert(strstr(msg, "DISPATCH_CUDA_PLUGIN"), "%s", msg);
}

Test(cuda_plugin, malformed_local_cuda_specs_are_einval) {
  static const char *const bad[] = {"local:cuda:", "local:cuda:x",
                                    "local:cuda:1234", "local:cudax",
                                    "local:cuda:0:1"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    dispatch_device *dev = NULL;
    char msg[1024];
    int rc = dispatch_device_open(bad[i], NULL, &dev, msg, sizeof msg);
    cr_assert_eq(rc, DISPATCH_EINVAL, "%s: %s", bad[i], msg);
    cr_assert(strstr(msg, "local:cuda:N"), "%s", msg);
  }
}

/* sp_run_capture's server with --device cuda:0: fails at start with one
 * line holding `want`. */
static void server_refuses(const char *want) {
  check_server_bin();
  char out[4096];
  const char *a[] = {"--listen", "127.0.0.1:0", "--device", "cuda:0", NULL};
  int st = sp_run_capture(a, out, sizeof out);
  cr_assert_neq(st, 0, "%s", out);
  cr_assert(strstr(out, want), "want \"%s\" in: %s", want, out);
  char *nl = strchr(out, '\n');
  cr_assert(nl && nl[1] == '\0', "one line, got: %s", out);
}

Test(cuda_plugin, server_without_the_plugin_says_so, .timeout = 120) {
  setenv("DISPATCH_CUDA_PLUGIN", "/nonexistent/dispatch-cuda.so", 1);
  server_refuses("--device cuda:0: CUDA plugin not found: "
                 "DISPATCH_CUDA_PLUGIN=/nonexistent/dispatch-cuda.so");
}

Test(cuda_plugin, a_file_that_is_not_the_plugin_is_refused) {
  char lib[4096], msg[2048];
  beside_server("libdispatch-client.so", lib, sizeof lib);
  dispatch_device *dev;
  int rc = open_with(lib, &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s", msg);
  cr_assert(strstr(msg, "is not a dispatch CUDA plugin: no "
                        "dispatch_cuda_plugin_v1"), "%s", msg);
}

/* a plugin of another ABI number (make builds it with or without CUDA) */
Test(cuda_plugin, a_stale_plugin_is_refused) {
  char fake[4096], msg[2048];
  beside_server("tests/fake-cuda-plugin.so", fake, sizeof fake);
  cr_assert_eq(access(fake, R_OK), 0, "%s not built", fake);
  dispatch_device *dev;
  int rc = open_with(fake, &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s", msg);
  cr_assert(strstr(msg, "stale CUDA plugin") && strstr(msg, fake), "%s", msg);
}

#if DSP_CUDA_BUILT
/* The real plugin: without a GPU it loads and says there is no device
 * or driver; with one, local:cuda:0 opens and reports itself. */
Test(cuda_plugin, local_cuda_with_the_plugin) {
  char plugin[4096], msg[2048];
  beside_server("dispatch-cuda.so", plugin, sizeof plugin);
  dispatch_device *dev;
  int rc = open_with(plugin, &dev, msg, sizeof msg);
  if (rc == 0) {
    dispatch_device_info info;
    int n = 0;
    cr_assert_eq(dispatch_device_list(dev, &info, 1, &n), 0);
    cr_assert_str_eq(info.kind, "cuda");
    cr_assert_str_eq(info.name, "local:cuda:0");
    dispatch_device_close(dev);
    printf("cuda_plugin: local:cuda:0 opened (%s)\n", info.description);
    return;
  }
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s: %s", dispatch_err_name(rc),
               msg);
  cr_assert(strstr(msg, "device \"local:cuda:0\": CUDA plugin ") &&
                strstr(msg, plugin) && strstr(msg, " loaded, but ") &&
                (strstr(msg, "no CUDA driver (libcuda.so.1") ||
                 strstr(msg, "no CUDA device")),
            "%s", msg);
}

Test(cuda_plugin, server_with_the_plugin_and_no_gpu, .timeout = 120) {
  char plugin[4096];
  beside_server("dispatch-cuda.so", plugin, sizeof plugin);
  dispatch_device *dev;
  char msg[2048];
  if (open_with(plugin, &dev, msg, sizeof msg) == 0) {
    dispatch_device_close(dev);
    printf("cuda_plugin: a GPU is here; the no-GPU error is not checked\n");
    return;
  }
  char want[4400];
  snprintf(want, sizeof want, "--device cuda:0: CUDA plugin %s loaded, but ",
           plugin);
  server_refuses(want);
}
#endif
