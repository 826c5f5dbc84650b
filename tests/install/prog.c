/* Built by tests/install/check-install.sh against an installed
 * libdispatch-client only (no path into the source tree): the public
 * headers must be self-contained and the library must link and run.
 * Prints "prog: ok VERSION" and exits 0 when every check holds. */
#include <dispatch_client.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  if (strcmp(dispatch_version(), DISPATCH_VERSION) != 0) {
    fprintf(stderr, "prog: library %s, header %s\n", dispatch_version(),
            DISPATCH_VERSION);
    return 1;
  }
  dispatch_options o = DISPATCH_OPTIONS_INIT;
  dispatch_device *dev;
  char msg[256];
  int rc = dispatch_device_open("local", &o, &dev, msg, sizeof msg);
  if (rc < 0) {
    fprintf(stderr, "prog: open: %s: %s\n", dispatch_err_name(rc), msg);
    return 1;
  }
  int64_t shape[1] = {3};
  float v[3] = {1, 2, 3}, out[3] = {0, 0, 0};
  dispatch_tensor *x = NULL, *y = NULL;
  rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, v, sizeof v, &x);
  if (rc == 0) rc = dispatch_mul(x, x, &y);
  if (rc == 0) rc = dispatch_tensor_read(y, out, sizeof out);
  dispatch_stats st = DISPATCH_STATS_INIT;
  if (rc == 0) rc = dispatch_device_stats(dev, &st);
  if (rc < 0) {
    fprintf(stderr, "prog: %s: %s\n", dispatch_err_name(rc),
            dispatch_device_errmsg(dev));
    dispatch_device_close(dev);
    return 1;
  }
  int ok = out[0] == 1 && out[1] == 4 && out[2] == 9 && st.tensors == 2;
  dispatch_device_close(dev);
  if (!ok) {
    fprintf(stderr, "prog: got %g %g %g, %llu tensors\n", out[0], out[1],
            out[2], (unsigned long long)st.tensors);
    return 1;
  }
  printf("prog: ok %s\n", dispatch_version());
  return 0;
}
