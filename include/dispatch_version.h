/* libdispatch-client: the version and the export marker.
 *
 * The three numbers below are the one place the version is defined: the
 * Makefile reads them from this file for the shared library's soname
 * (libdispatch-client.so.MAJOR), its file name, the pkg-config and CMake
 * package files, and dispatch-server --version; dispatch_version() returns
 * the library's own copy. Raise MAJOR on any change that breaks the ABI
 * (a removed or changed function, a struct field that moved), MINOR when
 * functions or trailing struct fields are added, PATCH otherwise. */
#ifndef DISPATCH_VERSION_H
#define DISPATCH_VERSION_H

#define DISPATCH_VERSION_MAJOR 0
#define DISPATCH_VERSION_MINOR 4
#define DISPATCH_VERSION_PATCH 0

#define DISPATCH__STR_(x) #x
#define DISPATCH__STR(x) DISPATCH__STR_(x)
/* "MAJOR.MINOR.PATCH" of the header compiled against, e.g. "0.1.0" */
#define DISPATCH_VERSION                                             \
  DISPATCH__STR(DISPATCH_VERSION_MAJOR)                              \
  "." DISPATCH__STR(DISPATCH_VERSION_MINOR) "." DISPATCH__STR(       \
      DISPATCH_VERSION_PATCH)
/* 0xMMmmpp, for compile-time comparisons */
#define DISPATCH_VERSION_HEX                                         \
  ((DISPATCH_VERSION_MAJOR << 16) | (DISPATCH_VERSION_MINOR << 8) | \
   DISPATCH_VERSION_PATCH)

/* Marks a function of the public API. The library is compiled with
 * -fvisibility=hidden, so only what carries this marker (and is listed in
 * client/dispatch-client.map) is exported from libdispatch-client.so. */
#if defined(__GNUC__) || defined(__clang__)
#define DISPATCH_API __attribute__((visibility("default")))
#else
#define DISPATCH_API
#endif

#endif
