/* Asserting a libdispatch-client call in a Criterion test: on failure the
 * message names the call, the code and the device's detail message. */
#ifndef TESTS_CLIENT_CHECK_H
#define TESTS_CLIENT_CHECK_H

#include <criterion/criterion.h>

#include "dispatch_client.h"

#define OK(dev, call)                                                  \
  do {                                                                 \
    int rc_ = (call);                                                  \
    cr_assert_eq(rc_, 0, "%s: %s: %s", #call, dispatch_err_name(rc_),  \
                 dispatch_device_errmsg(dev));                         \
  } while (0)

#endif
