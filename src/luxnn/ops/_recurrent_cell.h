/* The LSTM's kernels for one element type: included by _recurrent.c once per dtype, with T
 * the element type, TANH its tanh, GEMM the BLAS's cblas gemm for it and KERNEL(name) the
 * name with its dtype's suffix. Row and step strides are in elements. Each row is a
 * function of its own whose blocks are restrict parameters (disjoint, as the callers'
 * are), so that the compiler vectorises its loop; CLONES compiles it for the vector units
 * there are. */

typedef void (*KERNEL(gemm64_fn))(int, int, int, int64_t, int64_t, int64_t, T, const T *, int64_t, const T *,
                                  int64_t, T, T *, int64_t);
typedef void (*KERNEL(gemm32_fn))(int, int, int, int32_t, int32_t, int32_t, T, const T *, int32_t, const T *,
                                  int32_t, T, T *, int32_t);

/* C (m, n) = A (m, k) @ op(B), row-major; op(B) is B (k, n), or with trans_b B^T of B (n, k). */
static void
KERNEL(gemm)(int trans_b, npy_intp m, npy_intp n, npy_intp k, const T *a, npy_intp lda, const T *b, npy_intp ldb,
             T *c, npy_intp ldc)
{
    int tb = trans_b ? TRANS : NO_TRANS;
    if (blas_int64)
        ((KERNEL(gemm64_fn))GEMM)(ROW_MAJOR, NO_TRANS, tb, m, n, k, 1, a, lda, b, ldb, 0, c, ldc);
    else
        ((KERNEL(gemm32_fn))GEMM)(ROW_MAJOR, NO_TRANS, tb, (int32_t)m, (int32_t)n, (int32_t)k, 1, a, (int32_t)lda, b,
                                  (int32_t)ldb, 0, c, (int32_t)ldc);
}

CLONES static void
KERNEL(lstm_forward_row)(npy_intp H, T *restrict ai, T *restrict af, T *restrict ag, T *restrict ao,
                         const T *restrict cp, T *restrict h, T *restrict c, T *restrict tanh_c,
                         T *restrict h_next)
{
    for (npy_intp j = 0; j < H; j++) {
        T i = (T)0.5 * TANH((T)0.5 * ai[j]) + (T)0.5;
        T f = (T)0.5 * TANH((T)0.5 * af[j]) + (T)0.5;
        T g = TANH(ag[j]);
        T o = (T)0.5 * TANH((T)0.5 * ao[j]) + (T)0.5;
        ai[j] = i;
        af[j] = f;
        ag[j] = g;
        ao[j] = o;
        T cn = f * cp[j] + i * g;
        T tc = TANH(cn);
        c[j] = cn;
        tanh_c[j] = tc;
        h[j] = o * tc;
    }
    if (h_next != NULL) {
        for (npy_intp j = 0; j < H; j++)
            h_next[j] = h[j];
    }
}

static void
KERNEL(lstm_forward)(npy_intp rows, npy_intp H, T *gates, npy_intp s_gates, const T *c_prev, npy_intp s_cp, T *h,
                     npy_intp s_h, T *c, npy_intp s_c, T *tanh_c, npy_intp s_tc, T *h_next, npy_intp s_hn)
{
    for (npy_intp r = 0; r < rows; r++) {
        T *a = gates + r * s_gates;
        KERNEL(lstm_forward_row)(H, a, a + H, a + 2 * H, a + 3 * H, c_prev + r * s_cp, h + r * s_h, c + r * s_c,
                                 tanh_c + r * s_tc, h_next == NULL ? NULL : h_next + r * s_hn);
    }
}

CLONES static void
KERNEL(lstm_backward_row)(npy_intp H, const T *restrict ai, const T *restrict af, const T *restrict ag,
                          const T *restrict ao, const T *restrict tanh_c, const T *restrict cp,
                          const T *restrict gh, const T *restrict gc, T *restrict dh, T *restrict dc,
                          T *restrict di, T *restrict df, T *restrict dg, T *restrict d_o)
{
    if (gh != NULL) {
        for (npy_intp j = 0; j < H; j++) {
            dh[j] += gh[j];
            dc[j] += gc[j];
        }
    }
    for (npy_intp j = 0; j < H; j++) {
        T i = ai[j], f = af[j], g = ag[j], o = ao[j];
        T tc = tanh_c[j], dhj = dh[j];
        T dcj = dc[j] + dhj * o * ((T)1 - tc * tc);
        di[j] = dcj * g * i * ((T)1 - i);
        df[j] = dcj * cp[j] * f * ((T)1 - f);
        dg[j] = dcj * i * ((T)1 - g * g);
        d_o[j] = dhj * tc * o * ((T)1 - o);
        dc[j] = dcj * f;
    }
}

static void
KERNEL(lstm_backward)(npy_intp rows, npy_intp H, const T *gates, npy_intp s_gates, const T *tanh_c, npy_intp s_tc,
                      const T *c_prev, npy_intp s_cp, const T *g_out, npy_intp s_g, T *dh, npy_intp s_dh, T *dc,
                      npy_intp s_dc, T *d, npy_intp s_d)
{
    for (npy_intp r = 0; r < rows; r++) {
        const T *a = gates + r * s_gates;
        const T *g = g_out == NULL ? NULL : g_out + r * s_g;
        T *dr = d + r * s_d;
        KERNEL(lstm_backward_row)(H, a, a + H, a + 2 * H, a + 3 * H, tanh_c + r * s_tc, c_prev + r * s_cp, g,
                                  g == NULL ? NULL : g + H, dh + r * s_dh, dc + r * s_dc, dr, dr + H, dr + 2 * H,
                                  dr + 3 * H);
    }
}

/* A whole pass over a block of rows, step after step, the GEMMs through the BLAS: see
 * lstm_forward_pass and lstm_backward_pass in _recurrent.c for the arrays. */
static void
KERNEL(lstm_forward_pass)(npy_intp rows, npy_intp seq, npy_intp H, npy_intp K, int reverse, Block inputs,
                          const T *weights, npy_intp ldw, Block gates, Block out, Block tanh_c, const T *c0,
                          npy_intp s_c0)
{
    for (npy_intp k = 0; k < seq; k++) {
        npy_intp t = reverse ? seq - 1 - k : k, next = reverse ? t - 1 : t + 1, prev = reverse ? t + 1 : t - 1;
        T *a = AT(gates, t);
        KERNEL(gemm)(0, rows, 4 * H, K, AT(inputs, t), inputs.row, weights, ldw, a, gates.row);
        const T *c_prev = k == 0 ? c0 : AT(out, prev) + H;
        KERNEL(lstm_forward)(rows, H, a, gates.row, c_prev, k == 0 ? s_c0 : out.row, AT(out, t), out.row,
                             AT(out, t) + H, out.row, AT(tanh_c, t), tanh_c.row,
                             k + 1 < seq ? AT(inputs, next) : NULL, inputs.row);
    }
}

static void
KERNEL(lstm_backward_pass)(npy_intp rows, npy_intp seq, npy_intp H, int reverse, int need_h0, Block gates,
                           Block tanh_c, Block out, const T *c0, npy_intp s_c0, Block g, T *dhc, npy_intp s_dhc,
                           Block d, const T *w_hh, npy_intp ldw)
{
    for (npy_intp k = seq - 1; k >= 0; k--) {
        npy_intp t = reverse ? seq - 1 - k : k, prev = reverse ? t + 1 : t - 1;
        const T *c_prev = k == 0 ? c0 : AT(out, prev) + H;
        const T *g_t = g.data == NULL ? NULL : AT(g, t);
        KERNEL(lstm_backward)(rows, H, AT(gates, t), gates.row, AT(tanh_c, t), tanh_c.row, c_prev,
                              k == 0 ? s_c0 : out.row, g_t, g.row, dhc, s_dhc, dhc + H, s_dhc, AT(d, t), d.row);
        if (k > 0 || need_h0)
            KERNEL(gemm)(1, rows, H, 4 * H, AT(d, t), d.row, w_hh, ldw, dhc, s_dhc);
    }
}
