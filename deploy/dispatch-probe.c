/* dispatch-probe: a health check that speaks the protocol. It opens a
 * device on a dispatch-server (TCP or TLS connect, certificate check,
 * hello with the token) and waits for one Sync round trip, so it passes
 * only when the server accepts sessions, not merely when the port is open.
 * Used by the container's HEALTHCHECK, the Kubernetes readiness probe and
 * the deploy test.
 *
 *   dispatch-probe [--token-file FILE] [--ca FILE] [--cert FILE --key FILE]
 *                  [--server-name NAME] [--timeout-ms MS] [SPEC]
 *
 * SPEC is a device string (tls://localhost:7070); without it the library
 * takes $DISPATCH_DEVICE. Options left out fall back to the library's
 * environment variables (DISPATCH_TOKEN, DISPATCH_TLS_CA, ...). Prints one
 * line; exit status 0 healthy, 1 not healthy, 2 bad usage. */
#include <dispatch_client.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char g_usage[] =
    "usage: dispatch-probe [--token-file FILE] [--ca FILE] [--cert FILE "
    "--key FILE]\n"
    "                      [--server-name NAME] [--timeout-ms MS] [SPEC]\n";

/* Reads the token as the server does: the file's bytes less one trailing
 * newline (and a CR before it). Returns a malloc'd string or NULL after
 * printing why. */
static char *read_token(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "dispatch-probe: --token-file %s: ", path);
    perror(NULL);
    return NULL;
  }
  char buf[4097];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    fprintf(stderr, "dispatch-probe: --token-file %s: read error\n", path);
    return NULL;
  }
  if (n > 0 && buf[n - 1] == '\n') n--;
  if (n > 0 && buf[n - 1] == '\r') n--;
  buf[n] = '\0';
  char *t = malloc(n + 1);
  if (t) memcpy(t, buf, n + 1);
  memset(buf, 0, sizeof buf);
  return t;
}

int main(int argc, char **argv) {
  enum { O_TOKEN = 1, O_CA, O_CERT, O_KEY, O_NAME, O_TIMEOUT };
  static const struct option opts[] = {
      {"token-file", required_argument, NULL, O_TOKEN},
      {"ca", required_argument, NULL, O_CA},
      {"cert", required_argument, NULL, O_CERT},
      {"key", required_argument, NULL, O_KEY},
      {"server-name", required_argument, NULL, O_NAME},
      {"timeout-ms", required_argument, NULL, O_TIMEOUT},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  dispatch_options o;
  dispatch_options_init(&o);
  o.client_name = "dispatch-probe";
  o.timeout_ms = 5000;
  char *token = NULL;
  int c;
  while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
    case O_TOKEN:
      free(token);
      token = read_token(optarg);
      if (!token) return 1;
      o.token = token;
      break;
    case O_CA: o.ca_file = optarg; break;
    case O_CERT: o.cert_file = optarg; break;
    case O_KEY: o.key_file = optarg; break;
    case O_NAME: o.server_name = optarg; break;
    case O_TIMEOUT: {
      char *end;
      long v = strtol(optarg, &end, 10);
      if (*optarg == '\0' || *end != '\0' || v <= 0 || v > 3600000) {
        fprintf(stderr, "dispatch-probe: --timeout-ms: '%s' is not 1..3600000\n",
                optarg);
        free(token);
        return 2;
      }
      o.timeout_ms = (int)v;
      break;
    }
    case 'h':
      fputs(g_usage, stdout);
      free(token);
      return 0;
    default:
      fputs(g_usage, stderr);
      free(token);
      return 2;
    }
  }
  if (optind < argc - 1) {
    fputs(g_usage, stderr);
    free(token);
    return 2;
  }
  const char *spec = optind < argc ? argv[optind] : getenv("DISPATCH_DEVICE");
  if (!spec || !*spec || strcmp(spec, "local") == 0) {
    fprintf(stderr, "dispatch-probe: no server given (SPEC or DISPATCH_DEVICE)\n");
    free(token);
    return 2;
  }
  dispatch_device *dev = NULL;
  char err[512] = "";
  int rc = dispatch_device_open(spec, &o, &dev, err, sizeof err);
  if (rc == 0) {
    rc = dispatch_device_sync(dev);
    if (rc < 0) snprintf(err, sizeof err, "%s", dispatch_device_errmsg(dev));
  }
  dispatch_device_close(dev);
  if (token) memset(token, 0, strlen(token));
  free(token);
  if (rc < 0) {
    /* the code's name, not its generic text: "tensors live on different
     * devices" would misdescribe an unknown device of the server */
    printf("dispatch-probe: %s: %s: %s\n", spec, dispatch_err_name(rc), err);
    return 1;
  }
  printf("dispatch-probe: %s: ok\n", spec);
  return 0;
}
