#include <dispatch_client.h>
#include <stdio.h>

int main(void) {
  dispatch_device *dev;
  char err[256];
  /* NULL: the DISPATCH_DEVICE environment variable, else "local" */
  if (dispatch_device_open(NULL, NULL, &dev, err, sizeof err) < 0) {
    fprintf(stderr, "open: %s\n", err);
    return 1;
  }
  int64_t xs[2] = {2, 3}, w1s[2] = {3, 4}, w2s[2] = {4, 1};
  float xv[6] = {1, 2, 3, 4, 5, 6}, gv[4];
  dispatch_tensor *x, *w1, *w2, *h, *y, *loss, *g;
  dispatch_grads *grads = NULL;
  dispatch_scope_begin(dev); /* frees every tensor below at scope end */
  dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs, xv, sizeof xv, &x);
  dispatch_ones(dev, DISPATCH_F32, 2, w1s, &w1);
  dispatch_ones(dev, DISPATCH_F32, 2, w2s, &w2);
  dispatch_autodiff(w1, &w1);             /* AUTODIFF(w1): tracked leaf */
  dispatch_autodiff(w2, &w2);
  dispatch_matmul(x, w1, &h);             /* layer 1: relu(x @ w1) */
  dispatch_relu(h, &h);
  dispatch_matmul(h, w2, &y);             /* layer 2: h @ w2 */
  dispatch_sum(y, 0, NULL, 0, &loss);     /* sum over all dims */
  dispatch_backward(loss, &grads);        /* remote: one request */
  dispatch_grad(grads, w2, &g);
  dispatch_tensor_read(g, gv, sizeof gv); /* the only gradient transfer */
  /* One check for all of it: a call given the NULL output of a failed
   * call fails with the first error, which the device keeps. */
  const char *msg;
  int rc = dispatch_device_error(dev, &msg);
  if (rc < 0)
    fprintf(stderr, "error: %s\n", msg);
  else
    printf("dloss/dw2 = %g %g %g %g\n", gv[0], gv[1], gv[2], gv[3]);
  dispatch_grads_free(grads);
  dispatch_scope_end(dev);
  dispatch_device_close(dev);
  return rc < 0;
}
