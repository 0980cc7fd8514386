// The KV shift on the CPU as torch operators with their autograd in C++:
//
//   torch.ops.kvtrain.shift(x, coef, doc_ids)                         -> y
//   torch.ops.kvtrain.shift_qkv(mixed, coef_k, coef_v, doc_ids, q)    -> (query, key, value)
//
// Built on first use and loaded by kvtrain/model/native_shift.py. The math is
// shift_tokens' (kvtrain/model/kv_shift.py), per head and shifted tensor:
//
//     y_t  = sum_i c_i * x_{t-i}                       (t-i >= 0, same document)
//     dx_t = sum_i c_i * dy_{t+i}                      (t+i <  s, same document)
//     dc_i = sum_{t, b, d} dy_t * x_{t-i}              (t-i >= 0, same document)
//
// Why native: inside a training step on the CPU the shift's inputs are rarely in
// cache, so its cost is passes over memory and per-op overhead, not arithmetic.
// Here the forward is one pass over x, and the backward one pass that writes dx,
// the coefficient gradient and - for shift_qkv, which also stands in for the
// split of megatron's QKV output - the query's gradient straight into the
// gradient of the whole QKV output; the autograd node is C++ too (a Python
// autograd.Function costs more, per call, than the shift's memory traffic).
//
// Layout: x is [s, b, h, m, d] (m tensors side by side per head: K and V in the
// QKV output [s, b, g, q | d | d]) with any strides and a unit stride in d.
// Work is split into blocks of kBlockT tokens (of every sequence of the batch),
// walked in x's memory order (token, batch, head, tensor): walking one sequence
// at a time jumps a page per token and defeats the hardware prefetcher. The
// coefficient gradient is summed per block (each row's dot product in the
// element type, rows in double), then the blocks in order: the result does not
// depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kBlockT = 16;
constexpr int64_t kParallelMinElements = 1 << 15;  // torch's own grain size

// x [s, b, h, m, d] by pointer and strides; the documents of its tokens.
struct Layout {
  int64_t s, b, h, m, d, n;
  int64_t xs[4];
  const int64_t* docs = nullptr;
  int64_t ds[2] = {0, 0};

  bool same_doc(int64_t t, int64_t u, int64_t bb) const {
    return docs == nullptr || docs[t * ds[0] + bb * ds[1]] == docs[u * ds[0] + bb * ds[1]];
  }
  int64_t blocks() const { return (s + kBlockT - 1) / kBlockT; }
  int64_t grain() const {  // whole range in one thread below the grain size
    return s * b * h * m * d >= kParallelMinElements ? 1 : blocks();
  }
};

// y: m outputs [s, b, h, d] (contiguous); raw: null, or a contiguous copy of x
// [s, b, h, m, d] that the backward reads instead of x.
template <typename T>
void forward_kernel(const Layout& p, const T* x, const T* const* coef, T* const* y, T* raw) {
  at::parallel_for(0, p.blocks(), p.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * kBlockT; t < std::min(end * kBlockT, p.s); t++)
      for (int64_t bb = 0; bb < p.b; bb++)
        for (int64_t hh = 0; hh < p.h; hh++)
          for (int64_t mm = 0; mm < p.m; mm++) {
            const T* c = coef[mm] + hh * p.n;
            const T* xr = x + t * p.xs[0] + bb * p.xs[1] + hh * p.xs[2] + mm * p.xs[3];
            T* yr = y[mm] + ((t * p.b + bb) * p.h + hh) * p.d;
            if (raw != nullptr)
              std::memcpy(raw + (((t * p.b + bb) * p.h + hh) * p.m + mm) * p.d, xr,
                          sizeof(T) * p.d);
            const T c0 = c[0];
            for (int64_t k = 0; k < p.d; k++) yr[k] = c0 * xr[k];
            for (int64_t i = 1; i < p.n && i <= t; i++) {
              if (!p.same_doc(t, t - i, bb)) continue;
              const T ci = c[i];
              const T* xp = xr - i * p.xs[0];
              for (int64_t k = 0; k < p.d; k++) yr[k] += ci * xp[k];
            }
          }
  });
}

// Where the backward writes: dx (with strides dxs, or null), the query's gradient
// beside it (q_width values per row copied from q_src, zeros when q_src is null),
// the coefficient gradients (m pointers to [h, n], or empty).
template <typename T>
struct Grads {
  T* dx = nullptr;
  int64_t dxs[4] = {0, 0, 0, 0};
  int64_t q_width = 0;
  const T* q_src = nullptr;
  int64_t qs[3] = {0, 0, 0};
  T* q_dst = nullptr;  // with dx's strides in s, b, h
  std::vector<T*> dcoef;
};

template <typename T>
void backward_kernel(const Layout& p, const T* x, const std::vector<const T*>& dy,
                     const std::vector<std::array<int64_t, 3>>& dys,
                     const T* const* coef, Grads<T>& out) {
  const int64_t hmn = p.h * p.m * p.n;
  std::vector<double> partial(out.dcoef.empty() ? 0 : p.blocks() * hmn, 0.0);
  at::parallel_for(0, p.blocks(), p.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk++) {
      double* part = partial.empty() ? nullptr : partial.data() + blk * hmn;
      for (int64_t t = blk * kBlockT; t < std::min((blk + 1) * kBlockT, p.s); t++)
        for (int64_t bb = 0; bb < p.b; bb++)
          for (int64_t hh = 0; hh < p.h; hh++) {
            if (out.q_dst != nullptr) {  // the query's gradient, in the same row
              T* qd = out.q_dst + t * out.dxs[0] + bb * out.dxs[1] + hh * out.dxs[2];
              if (out.q_src != nullptr)
                std::memcpy(qd, out.q_src + t * out.qs[0] + bb * out.qs[1] + hh * out.qs[2],
                            sizeof(T) * out.q_width);
              else
                std::memset(qd, 0, sizeof(T) * out.q_width);
            }
            for (int64_t mm = 0; mm < p.m; mm++) {
              const T* c = coef[mm] + hh * p.n;
              const int64_t* gs = dys[mm].data();
              const T* g = dy[mm] + t * gs[0] + bb * gs[1] + hh * gs[2];
              if (out.dx != nullptr) {
                T* dr = out.dx + t * out.dxs[0] + bb * out.dxs[1] + hh * out.dxs[2] +
                        mm * out.dxs[3];
                const T c0 = c[0];
                for (int64_t k = 0; k < p.d; k++) dr[k] = c0 * g[k];
                for (int64_t i = 1; i < p.n && t + i < p.s; i++) {
                  if (!p.same_doc(t + i, t, bb)) continue;
                  const T ci = c[i];
                  const T* gi = g + i * gs[0];
                  for (int64_t k = 0; k < p.d; k++) dr[k] += ci * gi[k];
                }
              }
              if (part == nullptr) continue;
              const T* xr = x + t * p.xs[0] + bb * p.xs[1] + hh * p.xs[2] + mm * p.xs[3];
              double* pr = part + (hh * p.m + mm) * p.n;
              for (int64_t i = 0; i < p.n && i <= t; i++) {
                if (i > 0 && !p.same_doc(t, t - i, bb)) continue;
                const T* xp = xr - i * p.xs[0];
                T acc = 0;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < p.d; k++) acc += g[k] * xp[k];
                pr[i] += static_cast<double>(acc);
              }
            }
          }
    }
  });
  for (int64_t j = 0; j < (partial.empty() ? 0 : hmn); j++) {
    double sum = 0.0;
    for (int64_t blk = 0; blk < p.blocks(); blk++) sum += partial[blk * hmn + j];
    const int64_t mm = j / p.n % p.m, hh = j / (p.n * p.m), i = j % p.n;
    out.dcoef[mm][hh * p.n + i] = static_cast<T>(sum);
  }
}

// ---------------------------------------------------------------------------- tensors
void check_input(const Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "kvtrain.", name, ": CPU tensors only, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "kvtrain.",
              name, ": float32 or float64 only, got ", x.scalar_type());
  TORCH_CHECK(x.stride(-1) == 1, "kvtrain.", name, ": needs a unit stride in the last dim");
}

// x [s, b, h, m, d] by sizes and strides, and the documents of its tokens.
Layout layout(std::array<int64_t, 5> sizes, std::array<int64_t, 4> strides,
              int64_t n, const std::optional<Tensor>& docs) {
  Layout p{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], n,
           {strides[0], strides[1], strides[2], strides[3]}};
  if (docs.has_value() && docs->defined()) {
    TORCH_CHECK(docs->scalar_type() == at::kLong && docs->dim() == 2 &&
                    docs->size(0) == p.s && docs->size(1) == p.b,
                "kvtrain shift: doc_ids must be int64 [s, b]");
    p.docs = docs->data_ptr<int64_t>();
    p.ds[0] = docs->stride(0);
    p.ds[1] = docs->stride(1);
  }
  return p;
}

// Coefficients contiguous in x's dtype (no copy when they are already).
std::vector<Tensor> coefficients(const std::vector<Tensor>& coefs, const Tensor& x) {
  std::vector<Tensor> out;
  for (const auto& c : coefs) out.push_back(c.detach().to(x.scalar_type()).contiguous());
  return out;
}

template <typename T>
std::vector<const T*> pointers(const std::vector<Tensor>& ts) {
  std::vector<const T*> out;
  for (const auto& t : ts) out.push_back(t.data_ptr<T>());
  return out;
}

// The m gradients [s, b, h, d] as they come (undefined: zeros), unit stride in d.
std::vector<Tensor> output_grads(const variable_list& grads, size_t first, int64_t m,
                                 const Tensor& x, at::IntArrayRef shape) {
  std::vector<Tensor> out;
  for (int64_t j = 0; j < m; j++) {
    const Tensor& g = grads[first + j];
    if (!g.defined())
      out.push_back(at::zeros(shape, x.options()));
    else if (g.scalar_type() != x.scalar_type() || g.stride(-1) != 1)
      out.push_back(g.to(x.scalar_type()).contiguous());
    else
      out.push_back(g);
  }
  return out;
}

template <typename T>
void run_backward(const Layout& p, const Tensor& base, int64_t offset,
                  const std::vector<Tensor>& dys, const std::vector<Tensor>& coefs,
                  Grads<T>& out) {
  std::vector<std::array<int64_t, 3>> strides;
  for (const auto& g : dys) strides.push_back({g.stride(0), g.stride(1), g.stride(2)});
  backward_kernel<T>(p, base.data_ptr<T>() + offset, pointers<T>(dys), strides,
                     pointers<T>(coefs).data(), out);
}

// ---------------------------------------------------------------------------- shift_qkv
// mixed [s, b, g, q + 2d] -> query [s, b, g, q] (a view of mixed), key, value [s, b, g, d]
//
// What it keeps for backward is a copy of the raw K and V ([s, b, g, 2, d], written
// in the forward's pass), not mixed: attention keeps the shifted V (not a view of
// mixed), so once Q and K are rotated nothing holds the QKV output and it is freed.
// Saving mixed would keep the queries' share alive for the backward too. The
// shifted K and V are tensors of their own: K's is freed after RoPE.
struct ShiftQKV : public torch::autograd::Function<ShiftQKV> {
  static Layout kv_layout(const Tensor& mixed, int64_t q, int64_t n,
                          const std::optional<Tensor>& docs) {
    const int64_t d = (mixed.size(3) - q) / 2;
    return layout({mixed.size(0), mixed.size(1), mixed.size(2), 2, d},
                  {mixed.stride(0), mixed.stride(1), mixed.stride(2), d}, n, docs);
  }

  // the raw K/V copy [s, b, g, 2, d] (contiguous) of a mixed of these sizes
  static Layout raw_layout(const std::vector<int64_t>& mixed_sizes, int64_t q, int64_t n,
                           const std::optional<Tensor>& docs) {
    const int64_t b = mixed_sizes[1], g = mixed_sizes[2], d = (mixed_sizes[3] - q) / 2;
    return layout({mixed_sizes[0], b, g, 2, d}, {b * g * 2 * d, g * 2 * d, 2 * d, d}, n, docs);
  }

  static variable_list forward(AutogradContext* ctx, const Tensor& mixed, const Tensor& coef_k,
                               const Tensor& coef_v, const std::optional<Tensor>& doc_ids,
                               int64_t query_width) {
    check_input(mixed, "shift_qkv");
    const auto coefs = coefficients({coef_k, coef_v}, mixed);
    const Layout p = kv_layout(mixed, query_width, coef_k.size(1), doc_ids);
    Tensor key = at::empty({p.s, p.b, p.h, p.d}, mixed.options());
    Tensor value = at::empty({p.s, p.b, p.h, p.d}, mixed.options());
    // The raw copy serves the coefficients' gradient alone: none without one (fixed
    // coefficients); an empty tensor then carries the dtype to the backward.
    const bool keep_raw = coef_k.requires_grad() || coef_v.requires_grad();
    const std::vector<int64_t> raw_sizes =
        keep_raw ? std::vector<int64_t>{p.s, p.b, p.h, 2, p.d} : std::vector<int64_t>{0};
    Tensor raw = at::empty(raw_sizes, mixed.options());
    AT_DISPATCH_FLOATING_TYPES(mixed.scalar_type(), "kvtrain_shift_qkv", [&] {
      scalar_t* outs[2] = {key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>()};
      forward_kernel<scalar_t>(p, mixed.data_ptr<scalar_t>() + query_width,
                               pointers<scalar_t>(coefs).data(), outs,
                               keep_raw ? raw.data_ptr<scalar_t>() : nullptr);
    });
    ctx->save_for_backward({raw, coef_k, coef_v, doc_ids.value_or(Tensor())});
    ctx->saved_data["query_width"] = query_width;
    ctx->saved_data["mixed_sizes"] = mixed.sizes().vec();
    return {mixed.narrow(3, 0, query_width), key, value};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &raw = saved[0], &coef_k = saved[1], &coef_v = saved[2];
    const std::optional<Tensor> docs =
        saved[3].defined() ? std::optional<Tensor>(saved[3]) : std::nullopt;
    const int64_t q = ctx->saved_data["query_width"].toInt();
    const auto mixed_sizes = ctx->saved_data["mixed_sizes"].toIntVector();
    const bool need_mixed = ctx->needs_input_grad(0);
    const bool need_coef = (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) &&
                           raw.numel() > 0;
    const auto coefs = coefficients({coef_k, coef_v}, raw);
    const Layout p = raw_layout(mixed_sizes, q, coef_k.size(1), docs);
    const auto dys = output_grads(grads, 1, 2, raw, {p.s, p.b, p.h, p.d});
    Tensor dmixed, dck, dcv, dq = grads[0];
    if (need_mixed) dmixed = at::empty(mixed_sizes, raw.options());
    if (need_coef) {
      dck = at::empty(coefs[0].sizes(), raw.options());
      dcv = at::empty(coefs[1].sizes(), raw.options());
    }
    if (dq.defined() && (dq.scalar_type() != raw.scalar_type() || dq.stride(-1) != 1))
      dq = dq.to(raw.scalar_type()).contiguous();
    AT_DISPATCH_FLOATING_TYPES(raw.scalar_type(), "kvtrain_shift_qkv_backward", [&] {
      Grads<scalar_t> out;
      if (need_mixed) {
        const int64_t d = p.d;
        out.dx = dmixed.data_ptr<scalar_t>() + q;
        out.dxs[0] = dmixed.stride(0), out.dxs[1] = dmixed.stride(1);
        out.dxs[2] = dmixed.stride(2), out.dxs[3] = d;
        out.q_width = q;
        out.q_dst = q > 0 ? dmixed.data_ptr<scalar_t>() : nullptr;
        if (dq.defined()) {
          out.q_src = dq.data_ptr<scalar_t>();
          out.qs[0] = dq.stride(0), out.qs[1] = dq.stride(1), out.qs[2] = dq.stride(2);
        }
      }
      if (need_coef) out.dcoef = {dck.data_ptr<scalar_t>(), dcv.data_ptr<scalar_t>()};
      run_backward<scalar_t>(p, raw, 0, dys, coefs, out);
    });
    if (need_coef) {
      dck = dck.to(coef_k.scalar_type());
      dcv = dcv.to(coef_v.scalar_type());
    }
    return {dmixed, dck, dcv, Tensor(), Tensor()};
  }
};

// ---------------------------------------------------------------------------- shift
// x [s, b, h, d] (any strides, unit in d), coef [h, n] -> y [s, b, h, d]
struct Shift : public torch::autograd::Function<Shift> {
  static Layout x_layout(const Tensor& x, int64_t n, const std::optional<Tensor>& docs) {
    return layout({x.size(0), x.size(1), x.size(2), 1, x.size(3)},
                  {x.stride(0), x.stride(1), x.stride(2), x.size(3)}, n, docs);
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& coef,
                        const std::optional<Tensor>& doc_ids) {
    check_input(x, "shift");
    TORCH_CHECK(x.dim() == 4 && coef.dim() == 2 && coef.size(0) == x.size(2),
                "kvtrain.shift: expected x [s, b, h, d] and coef [h, n]");
    const auto coefs = coefficients({coef}, x);
    const Layout p = x_layout(x, coef.size(1), doc_ids);
    Tensor y = at::empty(x.sizes(), x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kvtrain_shift", [&] {
      scalar_t* outs[1] = {y.data_ptr<scalar_t>()};
      forward_kernel<scalar_t>(p, x.data_ptr<scalar_t>(), pointers<scalar_t>(coefs).data(), outs,
                               nullptr);
    });
    // x serves the coefficients' gradient alone: an empty tensor (x's dtype) instead
    // for fixed coefficients, so that nothing holds x (e.g. the QKV output) for backward
    const bool keep_x = coef.requires_grad();
    ctx->save_for_backward({keep_x ? x : at::empty({0}, x.options()), coef,
                            doc_ids.value_or(Tensor())});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["keep_x"] = keep_x;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &coef = saved[1];
    const std::optional<Tensor> docs =
        saved[2].defined() ? std::optional<Tensor>(saved[2]) : std::nullopt;
    const auto sizes = ctx->saved_data["x_sizes"].toIntVector();
    const bool have_x = ctx->saved_data["keep_x"].toBool();  // else: fixed, dx alone
    const auto coefs = coefficients({coef}, x);
    // without x, a layout of its sizes: the kernel reads x only for the coefficients
    const Layout p = have_x ? x_layout(x, coef.size(1), docs)
                            : layout({sizes[0], sizes[1], sizes[2], 1, sizes[3]},
                                     {0, 0, 0, 0}, coef.size(1), docs);
    const auto dys = output_grads(grads, 0, 1, x, sizes);
    Tensor dx, dcoef;
    if (ctx->needs_input_grad(0)) dx = at::empty(sizes, x.options());
    if (ctx->needs_input_grad(1) && have_x) dcoef = at::empty(coefs[0].sizes(), x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "kvtrain_shift_backward", [&] {
      Grads<scalar_t> out;
      if (dx.defined()) {
        out.dx = dx.data_ptr<scalar_t>();
        out.dxs[0] = dx.stride(0), out.dxs[1] = dx.stride(1), out.dxs[2] = dx.stride(2);
        out.dxs[3] = p.d;
      }
      if (dcoef.defined()) out.dcoef = {dcoef.data_ptr<scalar_t>()};
      run_backward<scalar_t>(p, x, 0, dys, coefs, out);
    });
    if (dcoef.defined()) dcoef = dcoef.to(coef.scalar_type());
    return {dx, dcoef, Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> shift_qkv(const Tensor& mixed, const Tensor& coef_k,
                                             const Tensor& coef_v,
                                             const std::optional<Tensor>& doc_ids,
                                             int64_t query_width) {
  TORCH_CHECK(mixed.dim() == 4 && coef_k.dim() == 2 && coef_k.sizes() == coef_v.sizes() &&
                  coef_k.size(0) == mixed.size(2) && query_width >= 0 &&
                  (mixed.size(3) - query_width) % 2 == 0,
              "kvtrain.shift_qkv: expected mixed [s, b, g, q + 2d] and coefficients [g, n]");
  auto out = ShiftQKV::apply(mixed, coef_k, coef_v, doc_ids, query_width);
  return {out[0], out[1], out[2]};
}

Tensor shift(const Tensor& x, const Tensor& coef, const std::optional<Tensor>& doc_ids) {
  return Shift::apply(x, coef, doc_ids);
}

}  // namespace

TORCH_LIBRARY(kvtrain, m) {
  m.def("shift(Tensor x, Tensor coef, Tensor? doc_ids) -> Tensor");
  m.def("shift_qkv(Tensor mixed, Tensor coef_k, Tensor coef_v, Tensor? doc_ids, "
        "int query_width) -> (Tensor, Tensor, Tensor)");
  m.impl("shift", c10::DispatchKey::CompositeImplicitAutograd, &shift);
  m.impl("shift_qkv", c10::DispatchKey::CompositeImplicitAutograd, &shift_qkv);
}
