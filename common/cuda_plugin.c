/* The CUDA plugin's loader (cuda_plugin.h): finds dispatch-cuda.so, opens
 * it with dlopen, checks its table against this build and lends it the
 * allocator. Linked into the server and the client library; never into
 * the plugin itself. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "cuda_plugin.h"
#include "dsp_internal.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const dsp_cuda_plugin *g_plugin;
static char g_path[PATH_MAX];
static char g_why[1536];

static const dsp_cuda_host g_host = {dsp_malloc, dsp_realloc, dsp_free};

/* The folder of `file` into dir ("" when it has none). */
static void dir_of(const char *file, char *dir, size_t len) {
  const char *slash = strrchr(file, '/');
  size_t n = slash ? (size_t)(slash - file) : 0;
  if (n >= len) n = 0;
  memcpy(dir, file, n);
  dir[n] = '\0';
}

/* The places of the search order after the variable, in order, as
 * "PATH\0PATH\0...\0" in out; returns how many. */
static int candidates(char out[][PATH_MAX], int max) {
  char dirs[2][PATH_MAX] = {"", ""};
  Dl_info info;
  if (dladdr((void *)candidates, &info) && info.dli_fname &&
      info.dli_fname[0] == '/')
    dir_of(info.dli_fname, dirs[0], sizeof dirs[0]);
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    dir_of(exe, dirs[1], sizeof dirs[1]);
  }
  static const char *const rel[] = {
      "/" DSP_CUDA_PLUGIN_FILE, "/dispatch/" DSP_CUDA_PLUGIN_FILE,
      "/../lib/dispatch/" DSP_CUDA_PLUGIN_FILE};
  int k = 0;
  for (int d = 0; d < 2; d++) {
    if (!dirs[d][0] || (d == 1 && strcmp(dirs[0], dirs[1]) == 0)) continue;
    for (size_t r = 0; r < sizeof rel / sizeof rel[0] && k < max; r++) {
      int w = snprintf(out[k], PATH_MAX, "%s%s", dirs[d], rel[r]);
      if (w > 0 && w < PATH_MAX) k++;
    }
  }
  return k;
}

static void attach_host(void) { g_plugin->attach(&g_host); }

/* Checks a table against this build: 0, or -1 with the reason in g_why. */
static int check_table(const dsp_cuda_plugin *p, const char *path) {
  const dsp_cuda_layout mine = DSP_CUDA_PLUGIN_LAYOUT;
  if (!p || p->abi != DSP_CUDA_PLUGIN_ABI || !p->version ||
      strcmp(p->version, DISPATCH_VERSION_STRING) != 0 ||
      memcmp(&p->layout, &mine, sizeof mine) != 0) {
    snprintf(g_why, sizeof g_why,
             "stale CUDA plugin %s: built for ABI %u, version %s; this "
             "program needs ABI %u, version %s and the same structure "
             "sizes (rebuild it from this tree: make %s)",
             path, p ? p->abi : 0u, p && p->version ? p->version : "?",
             DSP_CUDA_PLUGIN_ABI, DISPATCH_VERSION_STRING,
             "build/" DSP_CUDA_PLUGIN_FILE);
    return -1;
  }
  return 0;
}

/* dlopen's answer for one file: 1 loaded, 0 not there, -1 there but
 * refused (g_why says why). */
static int try_file(const char *path) {
  if (access(path, F_OK) != 0) return 0;
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(g_why, sizeof g_why,
             "CUDA plugin %s found but not loadable (the CUDA runtime "
             "libraries it needs, libcudart and libcublas, must be on the "
             "library path): %s",
             path, e ? e : "dlopen failed");
    return -1;
  }
  typedef const dsp_cuda_plugin *(*entry_fn)(void);
  entry_fn entry;
  *(void **)&entry = dlsym(h, DSP_CUDA_PLUGIN_ENTRY);
  if (!entry) {
    snprintf(g_why, sizeof g_why,
             "%s is not a dispatch CUDA plugin: no %s symbol", path,
             DSP_CUDA_PLUGIN_ENTRY);
    dlclose(h);
    return -1;
  }
  const dsp_cuda_plugin *p = entry();
  if (check_table(p, path) < 0) {
    dlclose(h);
    return -1;
  }
  snprintf(g_path, sizeof g_path, "%s", path);
  g_plugin = p;
  attach_host();
  return 1; /* the handle stays open for the process's life */
}

static void load_once(void) {
  const char *env = getenv("DISPATCH_CUDA_PLUGIN");
  if (env && *env) {
    int r = try_file(env);
    if (r == 0)
      snprintf(g_why, sizeof g_why,
               "CUDA plugin not found: DISPATCH_CUDA_PLUGIN=%s does not "
               "exist",
               env);
    return;
  }
  char c[6][PATH_MAX];
  int n = candidates(c, 6);
  char looked[1024] = "";
  size_t k = 0;
  for (int i = 0; i < n; i++) {
    int r = try_file(c[i]);
    if (r != 0) return;
    int w = snprintf(looked + k, sizeof looked - k, "%s%s", i ? ", " : "",
                     c[i]);
    if (w > 0 && (size_t)w < sizeof looked - k) k += (size_t)w;
  }
  snprintf(g_why, sizeof g_why,
           "CUDA plugin " DSP_CUDA_PLUGIN_FILE
           " not found (looked for %s; set DISPATCH_CUDA_PLUGIN to its "
           "path, or build it: make build/" DSP_CUDA_PLUGIN_FILE ")",
           n ? looked : "no place: cannot tell this program's folder");
}

int dsp_cuda_plugin_load(const dsp_cuda_plugin **out, char *why,
                         size_t why_len) {
  pthread_once(&g_once, load_once);
  *out = g_plugin;
  if (g_plugin) return 0;
  if (why && why_len) snprintf(why, why_len, "%s", g_why);
  return DISPATCH_EUNSUPPORTED;
}

const char *dsp_cuda_plugin_path(void) {
  pthread_once(&g_once, load_once);
  return g_path;
}

/* Why no device is usable into why: the driver's library named when it is
 * the one missing (the runtime then only says "CUDA driver version is
 * insufficient"), else the runtime's reason. */
static void no_device_why(const char *reason, char *why, size_t len) {
  void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (drv) {
    dlclose(drv);
    snprintf(why, len, "%s", reason);
    return;
  }
  const char *e = dlerror();
  snprintf(why, len, "no CUDA driver (%s)", e ? e : "libcuda.so.1 not found");
}

int dsp_cuda_plugin_open(int index, const dsp_cuda_plugin **plugin,
                         dsp_backend **out, char *why, size_t why_len) {
  *out = NULL;
  int rc = dsp_cuda_plugin_load(plugin, why, why_len);
  if (rc < 0) return rc;
  char reason[512] = "";
  rc = (*plugin)->backend_open(index, out, reason, sizeof reason);
  if (rc == DISPATCH_EUNSUPPORTED) {
    char r[640];
    no_device_why(reason, r, sizeof r);
    snprintf(why, why_len, "CUDA plugin %s loaded, but %s", g_path, r);
  } else if (rc < 0)
    snprintf(why, why_len, "%s", reason);
  return rc;
}

int dsp_cuda_plugin_describe(char *buf, size_t len) {
  const dsp_cuda_plugin *p;
  char why[1536];
  if (dsp_cuda_plugin_load(&p, why, sizeof why) < 0) {
    snprintf(buf, len, "cuda: %s", why);
    return 0;
  }
  char reason[512] = "";
  int n = p->device_count(reason, sizeof reason);
  if (n > 0) {
    snprintf(buf, len, "cuda: plugin %s loaded, %d GPU%s", g_path, n,
             n == 1 ? "" : "s");
    return n;
  }
  char r[640];
  no_device_why(reason, r, sizeof r);
  snprintf(buf, len, "cuda: plugin %s loaded, 0 GPUs: %s", g_path, r);
  return 0;
}
