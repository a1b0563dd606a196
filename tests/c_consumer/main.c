/* A plain C99 program that uses the installed libssm the way a C caller would: it links through the
 * CMake package (libssm::ssm) or pkg-config, checks the versions, runs ssm_selective_scan_fwd on host
 * arrays it fills itself, compares the result with a scalar loop written here from the header's formula,
 * and checks that a bad call fails with a message. Exits non-zero on any mismatch.
 * Usage: ssm_c_consumer [EXPECTED_VERSION]; compiled with -DSSM_EXPECTED_VERSION="x.y.z" (the version
 * the CMake package or pkg-config file states), it also checks the library against that. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libssm/ssm.h>

enum { BATCH = 2, DIM = 3, SEQLEN = 5, DSTATE = 4 };

static int failures = 0;

static void check(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "FAIL: %s\n", what);
    ++failures;
  }
}

static DLTensor host_f32(float* data, int32_t ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = NULL; /* compact row-major */
  t.byte_offset = 0;
  return t;
}

/* Deterministic values in [lo, hi). */
static void fill(float* x, int n, unsigned seed, float lo, float hi) {
  unsigned s = seed * 2654435761u + 12345u;
  int i;
  for (i = 0; i < n; ++i) {
    s = s * 1103515245u + 12345u;
    x[i] = lo + (hi - lo) * (float)((s >> 8) & 0xffff) / 65536.0f;
  }
}

static double softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }

/* The header's formula with variable B, C of shape (batch, dstate, seqlen), every option present. */
static void reference(const float* u, const float* delta, const float* A, const float* B,
                      const float* C, const float* D, const float* z, const float* delta_bias,
                      const float* h0, double* out, double* last) {
  int b, d, n, t;
  for (b = 0; b < BATCH; ++b) {
    for (d = 0; d < DIM; ++d) {
      double h[DSTATE];
      for (n = 0; n < DSTATE; ++n) h[n] = h0[(b * DIM + d) * DSTATE + n];
      for (t = 0; t < SEQLEN; ++t) {
        const int i = (b * DIM + d) * SEQLEN + t;
        const double dt = softplus((double)delta[i] + delta_bias[d]);
        double y = 0.0;
        for (n = 0; n < DSTATE; ++n) {
          const int j = (b * DSTATE + n) * SEQLEN + t;
          h[n] = exp(dt * A[d * DSTATE + n]) * h[n] + dt * B[j] * u[i];
          y += C[j] * h[n];
        }
        y += (double)D[d] * u[i];
        out[i] = y * (z[i] / (1.0 + exp(-(double)z[i])));
      }
      for (n = 0; n < DSTATE; ++n) last[(b * DIM + d) * DSTATE + n] = h[n];
    }
  }
}

int main(int argc, char** argv) {
  float u[BATCH * DIM * SEQLEN], delta[BATCH * DIM * SEQLEN], z[BATCH * DIM * SEQLEN];
  float A[DIM * DSTATE], B[BATCH * DSTATE * SEQLEN], C[BATCH * DSTATE * SEQLEN];
  float D[DIM], delta_bias[DIM], h0[BATCH * DIM * DSTATE];
  float out[BATCH * DIM * SEQLEN], last[BATCH * DIM * DSTATE];
  double want_out[BATCH * DIM * SEQLEN], want_last[BATCH * DIM * DSTATE];
  int64_t s_x[3] = {BATCH, DIM, SEQLEN}, s_A[2] = {DIM, DSTATE}, s_BC[3] = {BATCH, DSTATE, SEQLEN};
  int64_t s_D[1] = {DIM}, s_h[3] = {BATCH, DIM, DSTATE}, s_bad[3] = {BATCH, DSTATE, SEQLEN + 1};
  DLTensor tu, tdelta, tA, tB, tC, tD, tz, tbias, th0, tout, tlast, tbad;
  ssm_selective_scan_params params;
  size_t ws = 1;
  ssm_status st;
  double worst = 0.0;
  int i, nans = 0;

  printf("libssm %s, ABI %d\n", ssm_version(), ssm_abi_version());
  check(ssm_abi_version() == SSM_ABI_VERSION, "ssm_abi_version() equals the header's SSM_ABI_VERSION");
  if (argc > 1) check(strcmp(ssm_version(), argv[1]) == 0, "ssm_version() equals the package version");
#ifdef SSM_EXPECTED_VERSION
  check(strcmp(ssm_version(), SSM_EXPECTED_VERSION) == 0,
        "ssm_version() equals the version in the CMake package / pkg-config file");
#endif
  check(strcmp(ssm_status_string(SSM_ERROR_SHAPE), "SSM_ERROR_SHAPE") == 0, "ssm_status_string");

  fill(u, BATCH * DIM * SEQLEN, 1, -1.0f, 1.0f);
  fill(delta, BATCH * DIM * SEQLEN, 2, -2.0f, 1.0f);
  fill(z, BATCH * DIM * SEQLEN, 3, -2.0f, 2.0f);
  fill(A, DIM * DSTATE, 4, -1.5f, -0.1f);
  fill(B, BATCH * DSTATE * SEQLEN, 5, -1.0f, 1.0f);
  fill(C, BATCH * DSTATE * SEQLEN, 6, -1.0f, 1.0f);
  fill(D, DIM, 7, -1.0f, 1.0f);
  fill(delta_bias, DIM, 8, -0.5f, 0.5f);
  fill(h0, BATCH * DIM * DSTATE, 9, -1.0f, 1.0f);
  for (i = 0; i < BATCH * DIM * SEQLEN; ++i) out[i] = NAN;
  for (i = 0; i < BATCH * DIM * DSTATE; ++i) last[i] = NAN;

  tu = host_f32(u, 3, s_x);
  tdelta = host_f32(delta, 3, s_x);
  tz = host_f32(z, 3, s_x);
  tA = host_f32(A, 2, s_A);
  tB = host_f32(B, 3, s_BC);
  tC = host_f32(C, 3, s_BC);
  tD = host_f32(D, 1, s_D);
  tbias = host_f32(delta_bias, 1, s_D);
  th0 = host_f32(h0, 3, s_h);
  tout = host_f32(out, 3, s_x);
  tlast = host_f32(last, 3, s_h);

  memset(&params, 0, sizeof params);
  params.struct_size = sizeof params;
  params.delta_softplus = 1;

  st = ssm_selective_scan_fwd_workspace_size(&params, &tu, &tA, &tB, &tC, &ws);
  check(st == SSM_SUCCESS, "ssm_selective_scan_fwd_workspace_size succeeds");
  if (st != SSM_SUCCESS) fprintf(stderr, "  %s: %s\n", ssm_status_string(st), ssm_last_error());
  {
    void* workspace = ws ? malloc(ws) : NULL;
    st = ssm_selective_scan_fwd(&params, &tu, &tdelta, &tA, &tB, &tC, &tD, &tz, &tbias, &th0, &tout,
                                &tlast, workspace, ws, NULL);
    free(workspace);
  }
  check(st == SSM_SUCCESS, "ssm_selective_scan_fwd succeeds on host tensors");
  if (st != SSM_SUCCESS) fprintf(stderr, "  %s: %s\n", ssm_status_string(st), ssm_last_error());

  reference(u, delta, A, B, C, D, z, delta_bias, h0, want_out, want_last);
  for (i = 0; i < BATCH * DIM * SEQLEN; ++i) {
    const double err = fabs(out[i] - want_out[i]) / (1e-3 + fabs(want_out[i]));
    if (err != err) ++nans;
    else if (err > worst) worst = err;
  }
  for (i = 0; i < BATCH * DIM * DSTATE; ++i) {
    const double err = fabs(last[i] - want_last[i]) / (1e-3 + fabs(want_last[i]));
    if (err != err) ++nans;
    else if (err > worst) worst = err;
  }
  printf("worst relative error against the scalar loop: %.3g (%d NaN)\n", worst, nans);
  check(nans == 0 && worst <= 1e-4, "out and last_state match the scalar loop");

  /* B with the wrong seqlen: the call must fail, say why, and leave out untouched. */
  memcpy(want_last, out, sizeof out); /* reuse as a copy of out */
  tbad = host_f32(B, 3, s_bad);
  st = ssm_selective_scan_fwd(&params, &tu, &tdelta, &tA, &tbad, &tC, NULL, NULL, NULL, NULL, &tout,
                              NULL, NULL, 0, NULL);
  check(st == SSM_ERROR_SHAPE, "a mis-shaped B gives SSM_ERROR_SHAPE");
  check(strlen(ssm_last_error()) > 0, "a failed call leaves a message in ssm_last_error()");
  check(memcmp(want_last, out, sizeof out) == 0, "a failed call does not write its output");
  printf("bad call: %s: %s\n", ssm_status_string(st), ssm_last_error());

  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("ok\n");
  return 0;
}
