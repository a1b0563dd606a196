/* libssm: the public C API, all areas. Link through pkg-config (libssm) or CMake
 * (find_package(libssm), target libssm::ssm); there is no libssm.so link name to -lssm against. */
#ifndef LIBSSM_SSM_H_
#define LIBSSM_SSM_H_

#include "libssm/core.h"
#include "libssm/conv1d.h"
#include "libssm/norm.h"
#include "libssm/selective_scan.h"
#include "libssm/state_update.h"

#endif /* LIBSSM_SSM_H_ */
