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
  int64_t shape[2] = {2, 2};
  float xv[4] = {1, 2, 3, 4};
  dispatch_tensor *x, *w, *y, *loss;
  dispatch_grads *grads;
  dispatch_scope_begin(dev); /* frees every intermediate at scope end */
  dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, xv, sizeof xv, &x);
  dispatch_ones(dev, DISPATCH_F32, 2, shape, &w);
  dispatch_tensor *wt;
  dispatch_autodiff(w, &wt);                 /* AUTODIFF(w): tracked leaf */
  dispatch_matmul(x, wt, &y);
  dispatch_sum(y, 0, NULL, 0, &loss);        /* sum over all dims */
  if (dispatch_backward(loss, &grads) < 0) { /* remote: one request */
    fprintf(stderr, "backward: %s\n", dispatch_device_errmsg(dev));
    return 1;
  }
  dispatch_tensor *g;
  dispatch_grad(grads, wt, &g);
  float gv[4];
  dispatch_tensor_read(g, gv, sizeof gv);    /* the only gradient transfer */
  printf("dloss/dw = %g %g %g %g\n", gv[0], gv[1], gv[2], gv[3]);
  dispatch_grads_free(grads);
  dispatch_scope_end(dev);
  dispatch_device_close(dev);
  return 0;
}
