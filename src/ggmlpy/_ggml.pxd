# Extern declarations of ggml's C headers: the C boundary and nothing else.
# One `cdef extern` block per header, in ggml's order; names are verbatim.
# Only _core cimports this file.

from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdio cimport FILE


# ggml.h: contexts, tensors, ops, graphs
cdef extern from "ggml.h" nogil:
    enum:
        GGML_MAX_DIMS
        GGML_MAX_SRC
        GGML_MAX_NAME
        GGML_MAX_OP_PARAMS
        GGML_MEM_ALIGN
        GGML_DEFAULT_GRAPH_SIZE
        GGML_ROPE_TYPE_NORMAL
        GGML_ROPE_TYPE_NEOX
        GGML_ROPE_TYPE_MROPE
        GGML_ROPE_TYPE_VISION
        GGML_ROPE_TYPE_IMROPE
        GGML_MROPE_SECTIONS

    ctypedef void (*ggml_abort_callback_t)(const char * error_message)
    ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback)

    enum ggml_status:
        GGML_STATUS_ALLOC_FAILED
        GGML_STATUS_FAILED
        GGML_STATUS_SUCCESS
        GGML_STATUS_ABORTED
    const char * ggml_status_to_string(ggml_status status)

    ctypedef uint16_t ggml_fp16_t
    ctypedef struct ggml_bf16_t:
        uint16_t bits
    void ggml_fp16_to_fp32_row(const ggml_fp16_t *, float *, int64_t)
    void ggml_fp32_to_fp16_row(const float *, ggml_fp16_t *, int64_t)

    struct ggml_object
    struct ggml_context
    struct ggml_backend_buffer

    enum ggml_type:
        GGML_TYPE_F32
        GGML_TYPE_F16
        GGML_TYPE_Q4_0
        GGML_TYPE_Q8_0
        GGML_TYPE_I8
        GGML_TYPE_I16
        GGML_TYPE_I32
        GGML_TYPE_I64
        GGML_TYPE_F64
        GGML_TYPE_BF16
        GGML_TYPE_COUNT

    enum ggml_prec:
        GGML_PREC_DEFAULT
        GGML_PREC_F32

    enum ggml_op:
        GGML_OP_NONE
        GGML_OP_DUP
        GGML_OP_ADD_ID
        GGML_OP_ARGMAX
        GGML_OP_MUL_MAT_ID
        GGML_OP_CPY
        GGML_OP_CONT
        GGML_OP_RESHAPE
        GGML_OP_VIEW
        GGML_OP_PERMUTE
        GGML_OP_TRANSPOSE
        GGML_OP_GET_ROWS
        GGML_OP_SET_ROWS
        GGML_OP_ARGSORT
        GGML_OP_TOP_K
        GGML_OP_SSM_SCAN
        GGML_OP_COUNT

    enum ggml_unary_op:
        GGML_UNARY_OP_COUNT
    enum ggml_glu_op:
        GGML_GLU_OP_REGLU
        GGML_GLU_OP_GEGLU
        GGML_GLU_OP_SWIGLU
        GGML_GLU_OP_SWIGLU_OAI
        GGML_GLU_OP_GEGLU_ERF
        GGML_GLU_OP_GEGLU_QUICK
        GGML_GLU_OP_SWIGLU_CLAMP
        GGML_GLU_OP_COUNT

    enum ggml_log_level:
        GGML_LOG_LEVEL_NONE
        GGML_LOG_LEVEL_DEBUG
        GGML_LOG_LEVEL_INFO
        GGML_LOG_LEVEL_WARN
        GGML_LOG_LEVEL_ERROR
        GGML_LOG_LEVEL_CONT

    enum ggml_tensor_flag:
        GGML_TENSOR_FLAG_INPUT
        GGML_TENSOR_FLAG_OUTPUT
        GGML_TENSOR_FLAG_PARAM
        GGML_TENSOR_FLAG_LOSS
        GGML_TENSOR_FLAG_COMPUTE

    enum ggml_tri_type:
        GGML_TRI_TYPE_UPPER_DIAG
        GGML_TRI_TYPE_UPPER
        GGML_TRI_TYPE_LOWER_DIAG
        GGML_TRI_TYPE_LOWER

    struct ggml_init_params:
        size_t mem_size
        void * mem_buffer
        bint no_alloc

    struct ggml_tensor:
        ggml_type type
        ggml_backend_buffer * buffer
        int64_t ne[4]
        size_t nb[4]
        ggml_op op
        int32_t op_params[16]
        int32_t flags
        ggml_tensor * src[10]
        ggml_tensor * view_src
        size_t view_offs
        void * data
        char name[64]
        void * extra

    ctypedef bint (*ggml_abort_callback)(void * data)

    const char * ggml_version()
    const char * ggml_commit()
    void ggml_time_init()
    int64_t ggml_time_us()

    int64_t ggml_nelements(const ggml_tensor * tensor)
    int64_t ggml_nrows(const ggml_tensor * tensor)
    size_t ggml_nbytes(const ggml_tensor * tensor)
    int64_t ggml_blck_size(ggml_type type)
    size_t ggml_type_size(ggml_type type)
    size_t ggml_row_size(ggml_type type, int64_t ne)
    const char * ggml_type_name(ggml_type type)
    const char * ggml_op_name(ggml_op op)
    const char * ggml_op_symbol(ggml_op op)
    const char * ggml_unary_op_name(ggml_unary_op op)
    const char * ggml_glu_op_name(ggml_glu_op op)
    const char * ggml_op_desc(const ggml_tensor * t)
    size_t ggml_element_size(const ggml_tensor * tensor)
    bint ggml_is_quantized(ggml_type type)
    bint ggml_is_transposed(const ggml_tensor * tensor)
    bint ggml_is_permuted(const ggml_tensor * tensor)
    bint ggml_is_view(const ggml_tensor * tensor)
    int ggml_n_dims(const ggml_tensor * tensor)
    bint ggml_is_contiguous(const ggml_tensor * tensor)
    bint ggml_is_contiguous_1(const ggml_tensor * tensor)
    bint ggml_is_contiguous_2(const ggml_tensor * tensor)
    bint ggml_is_contiguous_rows(const ggml_tensor * tensor)
    bint ggml_are_same_shape(const ggml_tensor * t0, const ggml_tensor * t1)
    bint ggml_can_repeat(const ggml_tensor * t0, const ggml_tensor * t1)
    size_t ggml_tensor_overhead()
    bint ggml_validate_row_data(ggml_type type, const void * data, size_t nbytes)

    ggml_context * ggml_init(ggml_init_params params)
    void ggml_reset(ggml_context * ctx)
    void ggml_free(ggml_context * ctx)
    size_t ggml_used_mem(const ggml_context * ctx)
    bint ggml_get_no_alloc(ggml_context * ctx)
    void ggml_set_no_alloc(ggml_context * ctx, bint no_alloc)
    size_t ggml_get_mem_size(const ggml_context * ctx)
    size_t ggml_get_max_tensor_size(const ggml_context * ctx)

    ggml_tensor * ggml_new_tensor(ggml_context * ctx, ggml_type type, int n_dims, const int64_t * ne)
    ggml_tensor * ggml_dup_tensor(ggml_context * ctx, const ggml_tensor * src)
    ggml_tensor * ggml_view_tensor(ggml_context * ctx, ggml_tensor * src)
    ggml_tensor * ggml_get_first_tensor(const ggml_context * ctx)
    ggml_tensor * ggml_get_next_tensor(const ggml_context * ctx, ggml_tensor * tensor)
    ggml_tensor * ggml_get_tensor(ggml_context * ctx, const char * name)
    ggml_unary_op ggml_get_unary_op(const ggml_tensor * tensor)
    ggml_glu_op ggml_get_glu_op(const ggml_tensor * tensor)
    const char * ggml_get_name(const ggml_tensor * tensor)
    ggml_tensor * ggml_set_name(ggml_tensor * tensor, const char * name)
    void ggml_set_input(ggml_tensor * tensor)
    void ggml_set_output(ggml_tensor * tensor)
    void ggml_set_param(ggml_tensor * tensor)

    ggml_tensor * ggml_dup(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_add(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_add_inplace(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_add_cast(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_type type)
    ggml_tensor * ggml_add_id(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * ids)
    ggml_tensor * ggml_acc(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, size_t nb1, size_t nb2, size_t nb3, size_t offset)
    ggml_tensor * ggml_sub(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_mul(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_mul_inplace(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_div(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_sqr(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sqrt(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_log(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sin(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_cos(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sum(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sum_rows(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_cumsum(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_mean(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_argmax(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_count_equal(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_repeat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_repeat_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)
    ggml_tensor * ggml_concat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int dim)
    ggml_tensor * ggml_abs(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sgn(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_neg(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_step(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_tanh(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_elu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_relu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_leaky_relu(ggml_context * ctx, ggml_tensor * a, float negative_slope, bint inplace)
    ggml_tensor * ggml_sigmoid(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_gelu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_gelu_erf(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_gelu_quick(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_silu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_hardswish(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_hardsigmoid(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_exp(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_expm1(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_softplus(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_floor(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_ceil(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_round(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_trunc(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_glu(ggml_context * ctx, ggml_tensor * a, ggml_glu_op op, bint swapped)
    ggml_tensor * ggml_glu_split(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_glu_op op)
    ggml_tensor * ggml_swiglu_oai(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, float alpha, float limit)
    ggml_tensor * ggml_norm(ggml_context * ctx, ggml_tensor * a, float eps)
    ggml_tensor * ggml_rms_norm(ggml_context * ctx, ggml_tensor * a, float eps)
    ggml_tensor * ggml_group_norm(ggml_context * ctx, ggml_tensor * a, int n_groups, float eps)
    ggml_tensor * ggml_l2_norm(ggml_context * ctx, ggml_tensor * a, float eps)
    ggml_tensor * ggml_mul_mat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    void ggml_mul_mat_set_prec(ggml_tensor * a, ggml_prec prec)
    ggml_tensor * ggml_mul_mat_id(ggml_context * ctx, ggml_tensor * as_, ggml_tensor * b, ggml_tensor * ids)
    ggml_tensor * ggml_out_prod(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_scale(ggml_context * ctx, ggml_tensor * a, float s)
    ggml_tensor * ggml_scale_bias(ggml_context * ctx, ggml_tensor * a, float s, float b)
    ggml_tensor * ggml_set(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, size_t nb1, size_t nb2, size_t nb3, size_t offset)
    ggml_tensor * ggml_cpy(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_cast(ggml_context * ctx, ggml_tensor * a, ggml_type type)
    ggml_tensor * ggml_cont(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_cont_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)
    ggml_tensor * ggml_reshape_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)
    ggml_tensor * ggml_reshape_1d(ggml_context * ctx, ggml_tensor * a, int64_t ne0)
    ggml_tensor * ggml_reshape_2d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1)
    ggml_tensor * ggml_reshape_3d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2)
    ggml_tensor * ggml_view_1d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, size_t offset)
    ggml_tensor * ggml_view_2d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset)
    ggml_tensor * ggml_view_3d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, size_t nb1, size_t nb2, size_t offset)
    ggml_tensor * ggml_view_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset)
    ggml_tensor * ggml_permute(ggml_context * ctx, ggml_tensor * a, int axis0, int axis1, int axis2, int axis3)
    ggml_tensor * ggml_transpose(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_get_rows(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_set_rows(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c)
    ggml_tensor * ggml_diag(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_diag_mask_inf(ggml_context * ctx, ggml_tensor * a, int n_past)
    ggml_tensor * ggml_diag_mask_zero(ggml_context * ctx, ggml_tensor * a, int n_past)
    ggml_tensor * ggml_soft_max(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_soft_max_ext(ggml_context * ctx, ggml_tensor * a, ggml_tensor * mask, float scale, float max_bias)
    void ggml_soft_max_add_sinks(ggml_tensor * a, ggml_tensor * sinks)
    ggml_tensor * ggml_rope_ext(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow)
    ggml_tensor * ggml_rope_multi(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c, int n_dims, int * sections, int mode, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow)
    ggml_tensor * ggml_clamp(ggml_context * ctx, ggml_tensor * a, float min, float max)
    ggml_tensor * ggml_im2col(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int s0, int s1, int p0, int p1, int d0, int d1, bint is_2D, ggml_type dst_type)
    ggml_tensor * ggml_conv_1d(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int s0, int p0, int d0)
    ggml_tensor * ggml_conv_transpose_1d(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int s0, int p0, int d0)
    ggml_tensor * ggml_conv_2d(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int s0, int s1, int p0, int p1, int d0, int d1)
    enum ggml_op_pool:
        GGML_OP_POOL_MAX
        GGML_OP_POOL_AVG
    ggml_tensor * ggml_pool_1d(ggml_context * ctx, ggml_tensor * a, ggml_op_pool op, int k0, int s0, int p0)
    ggml_tensor * ggml_pool_2d(ggml_context * ctx, ggml_tensor * a, ggml_op_pool op, int k0, int k1, int s0, int s1, float p0, float p1)
    enum ggml_scale_mode:
        GGML_SCALE_MODE_NEAREST
        GGML_SCALE_MODE_BILINEAR
        GGML_SCALE_MODE_BICUBIC
    ggml_tensor * ggml_interpolate(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, uint32_t mode)
    ggml_tensor * ggml_pad_ext(ggml_context * ctx, ggml_tensor * a, int lp0, int rp0, int lp1, int rp1, int lp2, int rp2, int lp3, int rp3)
    ggml_tensor * ggml_pad_reflect_1d(ggml_context * ctx, ggml_tensor * a, int p0, int p1)
    ggml_tensor * ggml_roll(ggml_context * ctx, ggml_tensor * a, int shift0, int shift1, int shift2, int shift3)
    ggml_tensor * ggml_tri(ggml_context * ctx, ggml_tensor * a, ggml_tri_type type)
    ggml_tensor * ggml_fill(ggml_context * ctx, ggml_tensor * a, float c)
    ggml_tensor * ggml_timestep_embedding(ggml_context * ctx, ggml_tensor * timesteps, int dim, int max_period)
    enum ggml_sort_order:
        GGML_SORT_ORDER_ASC
        GGML_SORT_ORDER_DESC
    ggml_tensor * ggml_argsort(ggml_context * ctx, ggml_tensor * a, ggml_sort_order order)
    ggml_tensor * ggml_top_k(ggml_context * ctx, ggml_tensor * a, int k)
    ggml_tensor * ggml_arange(ggml_context * ctx, float start, float stop, float step)
    ggml_tensor * ggml_flash_attn_ext(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * mask, float scale, float max_bias, float logit_softcap)
    void ggml_flash_attn_ext_set_prec(ggml_tensor * a, ggml_prec prec)
    void ggml_flash_attn_ext_add_sinks(ggml_tensor * a, ggml_tensor * sinks)
    ggml_tensor * ggml_ssm_conv(ggml_context * ctx, ggml_tensor * sx, ggml_tensor * c)
    ggml_tensor * ggml_ssm_scan(ggml_context * ctx, ggml_tensor * s, ggml_tensor * x, ggml_tensor * dt, ggml_tensor * A, ggml_tensor * B, ggml_tensor * C, ggml_tensor * ids, int64_t K)
    ggml_tensor * ggml_gated_delta_net(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state, int64_t K)

    ggml_cgraph * ggml_new_graph_custom(ggml_context * ctx, size_t size, bint grads)
    void ggml_build_forward_expand(ggml_cgraph * cgraph, ggml_tensor * tensor)
    void ggml_graph_clear(ggml_cgraph * cgraph)
    int ggml_graph_size(ggml_cgraph * cgraph)
    ggml_tensor * ggml_graph_node(ggml_cgraph * cgraph, int i)
    int ggml_graph_n_nodes(ggml_cgraph * cgraph)
    size_t ggml_graph_overhead_custom(size_t size, bint grads)
    ggml_tensor * ggml_graph_get_tensor(const ggml_cgraph * cgraph, const char * name)
    void ggml_graph_print(const ggml_cgraph * cgraph)
    void ggml_graph_dump_dot(const ggml_cgraph * gb, const ggml_cgraph * cgraph, const char * filename)

    ctypedef void (*ggml_log_callback)(ggml_log_level level, const char * text, void * user_data) noexcept
    void ggml_log_set(ggml_log_callback log_callback, void * user_data)

    size_t ggml_quantize_chunk(ggml_type type, const float * src, void * dst, int64_t start, int64_t nrows, int64_t n_per_row, const float * imatrix)
    bint ggml_quantize_requires_imatrix(ggml_type type)

    struct ggml_threadpool_params:
        int n_threads
        unsigned int poll
        bint strict_cpu
        bint paused
    ggml_threadpool_params ggml_threadpool_params_default(int n_threads)

    ctypedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k)
    ctypedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k)
    struct ggml_type_traits:
        const char * type_name
        int64_t blck_size
        int64_t blck_size_interleave
        size_t type_size
        bint is_quantized
        ggml_to_float_t to_float
        ggml_from_float_t from_float_ref
    const ggml_type_traits * ggml_get_type_traits(ggml_type type)


# ggml-backend.h: devices, backends, buffers, scheduler (declared before ggml-alloc.h,
# whose declarations use its types)
cdef extern from "ggml-backend.h" nogil:
    enum ggml_backend_dev_type:
        GGML_BACKEND_DEVICE_TYPE_CPU
        GGML_BACKEND_DEVICE_TYPE_GPU
        GGML_BACKEND_DEVICE_TYPE_IGPU
        GGML_BACKEND_DEVICE_TYPE_ACCEL
        GGML_BACKEND_DEVICE_TYPE_META
    struct ggml_backend_device
    ctypedef ggml_backend_device * ggml_backend_dev_t
    struct ggml_backend_buffer_type
    ctypedef ggml_backend_buffer_type * ggml_backend_buffer_type_t
    ctypedef ggml_backend_buffer * ggml_backend_buffer_t
    struct ggml_backend
    ctypedef ggml_backend * ggml_backend_t
    struct ggml_backend_sched
    ctypedef ggml_backend_sched * ggml_backend_sched_t

    enum ggml_backend_buffer_usage:
        GGML_BACKEND_BUFFER_USAGE_ANY
        GGML_BACKEND_BUFFER_USAGE_WEIGHTS
        GGML_BACKEND_BUFFER_USAGE_COMPUTE

    struct ggml_backend_dev_caps:
        bint async_ "async"
        bint host_buffer
        bint buffer_from_host_ptr
        bint events
        bint mmap_support
    struct ggml_backend_dev_props:
        const char * name
        const char * description
        size_t memory_free
        size_t memory_total
        ggml_backend_dev_type type
        const char * device_id
        ggml_backend_dev_caps caps

    const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft)
    ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size)
    size_t ggml_backend_buft_get_alignment(ggml_backend_buffer_type_t buft)
    size_t ggml_backend_buft_get_max_size(ggml_backend_buffer_type_t buft)
    size_t ggml_backend_buft_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * tensor)
    bint ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft)
    ggml_backend_dev_t ggml_backend_buft_get_device(ggml_backend_buffer_type_t buft)

    const char * ggml_backend_buffer_name(ggml_backend_buffer_t buffer)
    void ggml_backend_buffer_free(ggml_backend_buffer_t buffer)
    void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer)
    size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer)
    void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value)
    bint ggml_backend_buffer_is_host(ggml_backend_buffer * buffer)
    void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer, ggml_backend_buffer_usage usage)
    ggml_backend_buffer_usage ggml_backend_buffer_get_usage(ggml_backend_buffer_t buffer)
    ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer)
    void ggml_backend_buffer_reset(ggml_backend_buffer_t buffer)

    const char * ggml_backend_name(ggml_backend_t backend)
    void ggml_backend_free(ggml_backend_t backend)
    ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend)
    size_t ggml_backend_get_alignment(ggml_backend_t backend)
    size_t ggml_backend_get_max_size(ggml_backend_t backend)
    void ggml_backend_tensor_set(ggml_tensor * tensor, const void * data, size_t offset, size_t size)
    void ggml_backend_tensor_get(const ggml_tensor * tensor, void * data, size_t offset, size_t size)
    void ggml_backend_tensor_memset(ggml_tensor * tensor, uint8_t value, size_t offset, size_t size)
    void ggml_backend_synchronize(ggml_backend_t backend)
    ggml_status ggml_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph)
    bint ggml_backend_supports_op(ggml_backend_t backend, const ggml_tensor * op)
    bint ggml_backend_supports_buft(ggml_backend_t backend, ggml_backend_buffer_type_t buft)
    ggml_backend_dev_t ggml_backend_get_device(ggml_backend_t backend)

    void ggml_backend_dev_get_props(ggml_backend_dev_t device, ggml_backend_dev_props * props)
    ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params)
    ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device)
    ggml_backend_buffer_type_t ggml_backend_dev_host_buffer_type(ggml_backend_dev_t device)
    bint ggml_backend_dev_supports_buft(ggml_backend_dev_t device, ggml_backend_buffer_type_t buft)
    bint ggml_backend_dev_offload_op(ggml_backend_dev_t device, const ggml_tensor * op)
    size_t ggml_backend_reg_dev_count(ggml_backend_reg * reg)
    ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg * reg, size_t index)

    ggml_backend_sched_t ggml_backend_sched_new(ggml_backend_t * backends, ggml_backend_buffer_type_t * bufts, int n_backends, size_t graph_size, bint parallel, bint op_offload)
    void ggml_backend_sched_free(ggml_backend_sched_t sched)
    void ggml_backend_sched_reserve_size(ggml_backend_sched_t sched, ggml_cgraph * measure_graph, size_t * sizes)
    bint ggml_backend_sched_reserve(ggml_backend_sched_t sched, ggml_cgraph * measure_graph)
    int ggml_backend_sched_get_n_backends(ggml_backend_sched_t sched)
    ggml_backend_t ggml_backend_sched_get_backend(ggml_backend_sched_t sched, int i)
    int ggml_backend_sched_get_n_splits(ggml_backend_sched_t sched)
    int ggml_backend_sched_get_n_copies(ggml_backend_sched_t sched)
    size_t ggml_backend_sched_get_buffer_size(ggml_backend_sched_t sched, ggml_backend_t backend)
    void ggml_backend_sched_set_tensor_backend(ggml_backend_sched_t sched, ggml_tensor * node, ggml_backend_t backend)
    ggml_backend_t ggml_backend_sched_get_tensor_backend(ggml_backend_sched_t sched, ggml_tensor * node)
    bint ggml_backend_sched_alloc_graph(ggml_backend_sched_t sched, ggml_cgraph * graph)
    ggml_status ggml_backend_sched_graph_compute(ggml_backend_sched_t sched, ggml_cgraph * graph)
    ggml_status ggml_backend_sched_graph_compute_async(ggml_backend_sched_t sched, ggml_cgraph * graph)
    void ggml_backend_sched_synchronize(ggml_backend_sched_t sched)
    void ggml_backend_sched_reset(ggml_backend_sched_t sched)
    ggml_status ggml_backend_view_init(ggml_tensor * tensor)
    ggml_backend_dev_t ggml_backend_dev_by_type(ggml_backend_dev_type type)
    bint ggml_backend_dev_supports_op(ggml_backend_dev_t device, const ggml_tensor * op)
    size_t ggml_backend_dev_count()
    ggml_backend_dev_t ggml_backend_dev_get(size_t index)
    const char * ggml_backend_dev_name(ggml_backend_dev_t device)
    const char * ggml_backend_dev_description(ggml_backend_dev_t device)
    void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total)
    # C keeps enum tags and functions apart; Cython does not, so this one is renamed.
    ggml_backend_dev_type ggml_backend_dev_type_of "ggml_backend_dev_type"(ggml_backend_dev_t device)
    struct ggml_backend_reg
    ctypedef ggml_backend_reg * ggml_backend_reg_t
    size_t ggml_backend_reg_count()
    ggml_backend_reg_t ggml_backend_reg_get(size_t index)
    const char * ggml_backend_reg_name(ggml_backend_reg_t reg)
    ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device)
    void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name)
    # what the CPU registry answers for "ggml_backend_dev_get_extra_bufts": a NULL-terminated array
    ctypedef ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)(ggml_backend_dev_t device)



# ggml-alloc.h: graph and context allocators
cdef extern from "ggml-alloc.h" nogil:
    struct ggml_gallocr
    ctypedef ggml_gallocr * ggml_gallocr_t
    ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft)
    void ggml_gallocr_free(ggml_gallocr_t galloc)
    bint ggml_gallocr_reserve(ggml_gallocr_t galloc, ggml_cgraph * graph)
    bint ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, ggml_cgraph * graph)
    size_t ggml_gallocr_get_buffer_size(ggml_gallocr_t galloc, int buffer_id)
    size_t ggml_backend_alloc_ctx_tensors_from_buft_size(ggml_context * ctx, ggml_backend_buffer_type_t buft)
    ggml_backend_buffer * ggml_backend_alloc_ctx_tensors_from_buft(ggml_context * ctx, ggml_backend_buffer_type_t buft)


# ggml-impl.h: ggml's internal header, for the graph's counts and visited set
# only. ggml asserts (aborts) when a graph is full; counting what an expand
# would add needs both, and the public API exposes neither n_leafs nor the set.
cdef extern from "ggml-impl.h" nogil:
    struct ggml_hash_set:
        size_t size
    struct ggml_cgraph:
        int size
        int n_nodes
        int n_leafs
        ggml_tensor ** nodes
        ggml_tensor ** leafs
        ggml_hash_set visited_hash_set
    bint ggml_hash_contains(const ggml_hash_set * hash_set, ggml_tensor * key)


# ggml-cpu.h: graph compute on the host. Reached through ggmlpy_cpu.h, which in a
# portable build (GGMLPY_BACKEND_DL) sends these names to the CPU variant ggml chose.
cdef extern from "ggmlpy_cpu.h" nogil:
    bint GGMLPY_BACKEND_DL
    int ggmlpy_cpu_load(const char * dir, char * err, size_t err_size)
    const char * ggmlpy_cpu_path()
    struct ggml_threadpool
    ggml_threadpool * ggml_threadpool_new(ggml_threadpool_params * params)
    void ggml_threadpool_free(ggml_threadpool * threadpool)
    struct ggml_cplan:
        size_t work_size
        uint8_t * work_data
        int n_threads
        ggml_threadpool * threadpool
        ggml_abort_callback abort_callback
        void * abort_callback_data
        bint use_ref
    ggml_cplan ggml_graph_plan(const ggml_cgraph * cgraph, int n_threads, ggml_threadpool * threadpool)
    ggml_status ggml_graph_compute(ggml_cgraph * cgraph, ggml_cplan * cplan)
    ggml_backend_t ggml_backend_cpu_init()
    bint ggml_backend_is_cpu(ggml_backend_t backend)
    void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads)
    void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, ggml_threadpool * threadpool)
    void ggml_backend_cpu_set_abort_callback(ggml_backend_t backend_cpu, ggml_abort_callback abort_callback, void * abort_callback_data)
    int ggml_cpu_has_sse3()
    int ggml_cpu_has_avx()
    int ggml_cpu_has_avx2()
    int ggml_cpu_has_avx_vnni()
    int ggml_cpu_has_f16c()
    int ggml_cpu_has_fma()
    int ggml_cpu_has_avx512()
    int ggml_cpu_has_avx512_vbmi()
    int ggml_cpu_has_avx512_vnni()
    int ggml_cpu_has_avx512_bf16()
    int ggml_cpu_has_amx_int8()
    int ggml_cpu_has_neon()
    int ggml_cpu_has_dotprod()
    int ggml_cpu_has_sve()
    int ggml_cpu_has_llamafile()



# gguf.h: the GGUF file format. Most getters and setters GGML_ASSERT (abort) on
# a wrong index, a type mismatch, an empty key, a duplicate tensor name or a
# general.alignment that is not a power-of-two u32: gguf.pxi checks first.
cdef extern from "gguf.h" nogil:
    enum:
        GGUF_VERSION
        GGUF_DEFAULT_ALIGNMENT
    enum gguf_type:
        GGUF_TYPE_UINT8
        GGUF_TYPE_INT8
        GGUF_TYPE_UINT16
        GGUF_TYPE_INT16
        GGUF_TYPE_UINT32
        GGUF_TYPE_INT32
        GGUF_TYPE_FLOAT32
        GGUF_TYPE_BOOL
        GGUF_TYPE_STRING
        GGUF_TYPE_ARRAY
        GGUF_TYPE_UINT64
        GGUF_TYPE_INT64
        GGUF_TYPE_FLOAT64
        GGUF_TYPE_COUNT
    struct gguf_context
    struct gguf_init_params:
        bint no_alloc
        ggml_context ** ctx
    gguf_context * gguf_init_empty()
    gguf_context * gguf_init_from_file(const char * fname, gguf_init_params params)
    gguf_context * gguf_init_from_buffer(const void * data, size_t size, gguf_init_params params)
    void gguf_free(gguf_context * ctx)
    const char * gguf_type_name(gguf_type type)
    uint32_t gguf_get_version(const gguf_context * ctx)
    size_t gguf_get_alignment(const gguf_context * ctx)
    size_t gguf_get_data_offset(const gguf_context * ctx)
    int64_t gguf_get_n_kv(const gguf_context * ctx)
    int64_t gguf_find_key(const gguf_context * ctx, const char * key)
    const char * gguf_get_key(const gguf_context * ctx, int64_t key_id)
    gguf_type gguf_get_kv_type(const gguf_context * ctx, int64_t key_id)
    gguf_type gguf_get_arr_type(const gguf_context * ctx, int64_t key_id)
    const char * gguf_get_val_str(const gguf_context * ctx, int64_t key_id)
    const void * gguf_get_val_data(const gguf_context * ctx, int64_t key_id)
    size_t gguf_get_arr_n(const gguf_context * ctx, int64_t key_id)
    const void * gguf_get_arr_data(const gguf_context * ctx, int64_t key_id)
    const char * gguf_get_arr_str(const gguf_context * ctx, int64_t key_id, size_t i)
    int64_t gguf_get_n_tensors(const gguf_context * ctx)
    int64_t gguf_find_tensor(const gguf_context * ctx, const char * name)
    size_t gguf_get_tensor_offset(const gguf_context * ctx, int64_t tensor_id)
    const char * gguf_get_tensor_name(const gguf_context * ctx, int64_t tensor_id)
    const int64_t * gguf_get_tensor_ne(const gguf_context * ctx, int64_t tensor_id)
    ggml_type gguf_get_tensor_type(const gguf_context * ctx, int64_t tensor_id)
    size_t gguf_get_tensor_size(const gguf_context * ctx, int64_t tensor_id)
    void gguf_set_val_u8(gguf_context * ctx, const char * key, uint8_t val)
    void gguf_set_val_i8(gguf_context * ctx, const char * key, int8_t val)
    void gguf_set_val_u16(gguf_context * ctx, const char * key, uint16_t val)
    void gguf_set_val_i16(gguf_context * ctx, const char * key, int16_t val)
    void gguf_set_val_u32(gguf_context * ctx, const char * key, uint32_t val)
    void gguf_set_val_i32(gguf_context * ctx, const char * key, int32_t val)
    void gguf_set_val_f32(gguf_context * ctx, const char * key, float val)
    void gguf_set_val_u64(gguf_context * ctx, const char * key, uint64_t val)
    void gguf_set_val_i64(gguf_context * ctx, const char * key, int64_t val)
    void gguf_set_val_f64(gguf_context * ctx, const char * key, double val)
    void gguf_set_val_bool(gguf_context * ctx, const char * key, bint val)
    void gguf_set_val_str(gguf_context * ctx, const char * key, const char * val)
    void gguf_set_arr_data(gguf_context * ctx, const char * key, gguf_type type, const void * data, size_t n)
    void gguf_set_arr_str(gguf_context * ctx, const char * key, const char ** data, size_t n)
    void gguf_add_tensor(gguf_context * ctx, const ggml_tensor * tensor)
    size_t gguf_get_meta_size(const gguf_context * ctx)
    void gguf_get_meta_data(const gguf_context * ctx, void * data)

# ggml-rpc.h: remote devices over TCP. Reached through ggmlpy_rpc.h, which
# compiles to stubs when ggml was built without GGML_RPC.
cdef extern from "ggmlpy_rpc.h" nogil:
    bint GGMLPY_HAVE_RPC
    bint GGMLPY_RPC_ERRORS
    bint GGMLPY_RPC_SERVER_LIMITS
    int ggmlpy_rpc_load(const char * dir, char * err, size_t err_size)
    int RPC_PROTO_MAJOR_VERSION
    int RPC_PROTO_MINOR_VERSION
    void ggml_backend_rpc_set_timeout_ms(uint32_t timeout_ms)
    int ggml_backend_rpc_take_error(char * endpoint, size_t endpoint_size)
    void ggml_backend_rpc_server_set_limits(uint32_t timeout_ms, uint32_t max_clients)
    ggml_backend_reg * ggml_backend_rpc_add_server(const char * endpoint)
    void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads,
                                       size_t n_devices, ggml_backend_dev_t * devices)

# ggmlpy_budget.h: a device that is another one holding at most a byte budget,
# for RPC servers that advertise a memory size (rpc_start_server's mem).
cdef extern from "ggmlpy_budget.h" nogil:
    ggml_backend_dev_t ggmlpy_budget_device_new(ggml_backend_dev_t dev, size_t budget)
