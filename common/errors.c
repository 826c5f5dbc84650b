/* Name and message functions generated from the one error table. */
#include "dispatch_errors.h"

const char *dispatch_err_name(int code) {
  switch (code) {
#define NAME_CASE_(name, c, msg) \
  case c:                        \
    return "DISPATCH_" #name;
    DISPATCH_ERRNO_MAP(NAME_CASE_)
#undef NAME_CASE_
  }
  return "DISPATCH_EUNKNOWN";
}

const char *dispatch_strerror(int code) {
  switch (code) {
#define MSG_CASE_(name, c, msg) \
  case c:                       \
    return msg;
    DISPATCH_ERRNO_MAP(MSG_CASE_)
#undef MSG_CASE_
  }
  return "unknown error";
}
