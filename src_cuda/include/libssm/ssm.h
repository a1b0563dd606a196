/* libssm: the public C API, all areas. Link with -lssm (pkg-config libssm, or CMake
 * find_package(libssm) and target libssm::ssm). */
#ifndef LIBSSM_SSM_H_
#define LIBSSM_SSM_H_

#include "libssm/core.h"
#include "libssm/selective_scan.h"

#endif /* LIBSSM_SSM_H_ */
