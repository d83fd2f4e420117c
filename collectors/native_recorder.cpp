// Native recording of gloo collectives: the rows collectors/collective_recorder.py's drain thread reads in batches.
//
// A RecordingBackend is a c10d Backend registered on a recording process group (pg_wrapper._NativeGlooGroup): it
// forwards every collective to the real backend and records its row (pg, seq, op, bytes, dtype, step, enqueue time,
// restart) in a Recorder, in flight until a done-callback on the work's future stamps its end, on the thread that
// completed the work (no GIL). Works without a future (gloo reduce-scatter) are wrapped and stamped when wait()
// returns. Point-to-point calls are left to the Python group. Built by collectors/native_build.py.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

int64_t now_ns() {    // time.time_ns(): CLOCK_REALTIME
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

enum Op : int8_t { ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCE_SCATTER, ALLTOALL, GATHER, SCATTER, BARRIER,
                   NUM_OPS };
const char* const kOpNames[NUM_OPS] = {"allreduce", "broadcast", "reduce",  "allgather", "reduce_scatter",
                                       "alltoall",  "gather",    "scatter", "barrier"};
constexpr int16_t kNoDtype = -1;

struct Row {          // collective_recorder.ROW_COLUMNS; timing is always "host"
  int32_t pg;
  int8_t op;
  int16_t dtype;
  int64_t seq, num_bytes, step, enqueue_ns, restart;
  bool ended = false;
  int64_t end_ns = 0;
};

struct InFlight {
  Row row;
  bool seen = false;      // in flight at the previous tick
  bool spilled = false;   // already written to ``pending``
};

struct Progress {         // collective_recorder.GroupProgress
  bool issued = false;
  int64_t issued_seq = 0, issued_step = 0, issued_ns = 0;
  int8_t issued_op = 0;
  int64_t completed_seq = 0;
  int8_t completed_op = -1;
};

class Recorder;
thread_local std::vector<const Recorder*> paused_here;   // CollectiveRecorder.paused(), per thread

// The rows of one CollectiveRecorder: in flight, finished (until the drain takes them), and each group's progress.
class Recorder {
 public:
  Recorder() = default;
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // Its last owner may be a gloo thread (a done-callback) or the interpreter's exit: the Python objects it keeps
  // are released with the GIL, or left to the exiting interpreter.
  ~Recorder() {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      py::gil_scoped_acquire gil;
      op_names_.clear();
      pg_names_.clear();
      dtype_cache_.clear();
      host_ = py::object();
    } else {
      for (auto& name : op_names_) name.release();
      for (auto& name : pg_names_) name.release();
      for (auto& entry : dtype_cache_) entry.second.release();
      host_.release();
    }
  }

  std::atomic<bool> writing{false};      // the Python recorder has a writer
  std::atomic<bool> enqueue_timing{false};
  std::atomic<int64_t> step{-1};
  std::atomic<int64_t> restart{0};

  bool recording() const {
    if (!writing.load(std::memory_order_relaxed)) return false;
    for (const Recorder* r : paused_here) {
      if (r == this) return false;
    }
    return true;
  }

  void set_paused(bool on) {
    if (on) {
      paused_here.push_back(this);
    } else {
      for (auto it = paused_here.rbegin(); it != paused_here.rend(); ++it) {
        if (*it == this) {
          paused_here.erase(std::next(it).base());
          break;
        }
      }
    }
  }

  int32_t intern(const std::string& pg) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pg_index_.find(pg);
    if (it != pg_index_.end()) return it->second;
    int32_t index = static_cast<int32_t>(pgs_.size());
    pgs_.push_back(pg);
    pg_index_.emplace(pg, index);
    return index;
  }

  // A collective issued: in flight until ``complete`` (returns its key).
  int64_t track(const Row& row) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t key = next_key_++;
    in_flight_.emplace_hint(in_flight_.end(), key, InFlight{row});
    Progress& p = progress_[row.pg];
    p.issued = true;
    p.issued_seq = row.seq;
    p.issued_op = row.op;
    p.issued_step = row.step;
    p.issued_ns = row.enqueue_ns;
    return key;
  }

  // A collective completed (``ended``: at ``end_ns``; else written without an end); nothing if already written.
  void complete(int64_t key, bool ended, int64_t end_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(key);
    if (it == in_flight_.end()) return;
    Row row = it->second.row;
    in_flight_.erase(it);
    Progress& p = progress_[row.pg];
    if (row.seq > p.completed_seq) {
      p.completed_seq = row.seq;
      p.completed_op = row.op;
    }
    if (writing.load(std::memory_order_relaxed)) {
      row.ended = ended;
      row.end_ns = end_ns;
      done_.push_back(row);
    }
  }

  // A row written as issued, without an end (timing "enqueue").
  void emit(const Row& row) {
    std::lock_guard<std::mutex> lock(mu_);
    if (writing.load(std::memory_order_relaxed)) done_.push_back(row);
  }

  size_t num_in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_.size();
  }

  // Every in-flight row written without an end (close); returns how many.
  size_t flush_in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = in_flight_.size();
    for (auto& entry : in_flight_) {
      if (writing.load(std::memory_order_relaxed)) done_.push_back(entry.second.row);
    }
    in_flight_.clear();
    return n;
  }

  // The finished rows since the last call, as ROW_COLUMNS tuples (end_ns last; absent for a row without an end).
  py::list take() {
    std::vector<Row> rows;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      rows.swap(done_);
    }
    return as_list(rows, true);
  }

  // The in-flight rows, oldest first, as tuples without end_ns.
  py::list in_flight() {
    std::vector<Row> rows;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      rows.reserve(in_flight_.size());
      for (auto& entry : in_flight_) rows.push_back(entry.second.row);
    }
    return as_list(rows, false);
  }

  // One drain tick: the rows in flight at the previous tick too and not spilled yet (marked spilled now), oldest
  // first; every row in flight is marked seen.
  py::list spill() {
    std::vector<Row> rows;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& entry : in_flight_) {
        InFlight& f = entry.second;
        if (f.seen && !f.spilled) {
          f.spilled = true;
          rows.push_back(f.row);
        }
        f.seen = true;
      }
    }
    return as_list(rows, false);
  }

  // Forget which rows were seen or spilled (a new writer).
  void reset_ticks() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : in_flight_) entry.second.seen = entry.second.spilled = false;
  }

  // Per group that issued: (pg, issued seq, op, step, enqueue_ns, completed seq, completed op or None).
  py::list progress() {
    std::vector<std::pair<int32_t, Progress>> groups;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& entry : progress_) {
        if (entry.second.issued) groups.emplace_back(entry.first, entry.second);
      }
    }
    py::list out;
    for (auto& [pg, p] : groups) {
      py::object completed_op = p.completed_op < 0 ? py::none() : op_name(p.completed_op);
      out.append(py::make_tuple(pg_name(pg), p.issued_seq, op_name(p.issued_op), p.issued_step, p.issued_ns,
                                p.completed_seq, completed_op));
    }
    return out;
  }

  static void set_dtype_name(const at::Tensor& t, const std::string& name) {
    dtype_names()[static_cast<int16_t>(t.scalar_type())] = name;
  }

 private:
  static std::unordered_map<int16_t, std::string>& dtype_names() {
    static std::unordered_map<int16_t, std::string> names;
    return names;
  }

  py::object op_name(int8_t op) {
    if (op_names_.empty()) {
      for (const char* name : kOpNames) op_names_.push_back(py::str(name));
    }
    return op_names_[op];
  }

  py::object pg_name(int32_t pg) {
    while (static_cast<int32_t>(pg_names_.size()) <= pg) {
      std::string name;
      {
        std::lock_guard<std::mutex> lock(mu_);
        name = pgs_[pg_names_.size()];
      }
      pg_names_.push_back(py::str(name));
    }
    return pg_names_[pg];
  }

  py::object dtype_name(int16_t dtype) {
    if (dtype == kNoDtype) return py::none();
    auto it = dtype_cache_.find(dtype);
    if (it != dtype_cache_.end()) return it->second;
    auto named = dtype_names().find(dtype);
    std::string name = named != dtype_names().end()
        ? named->second
        : std::string(c10::toString(static_cast<c10::ScalarType>(dtype)));
    return dtype_cache_.emplace(dtype, py::str(name)).first->second;
  }

  py::tuple as_tuple(const Row& r, bool with_end) {
    if (host_.is_none()) host_ = py::str("host");
    py::tuple t(with_end ? 10 : 9);
    t[0] = pg_name(r.pg);
    t[1] = py::int_(r.seq);
    t[2] = op_name(r.op);
    t[3] = py::int_(r.num_bytes);
    t[4] = dtype_name(r.dtype);
    t[5] = py::int_(r.step);
    t[6] = host_;
    t[7] = py::int_(r.enqueue_ns);
    t[8] = py::int_(r.restart);
    if (with_end) t[9] = py::int_(r.end_ns);
    return t;
  }

  // ``rows`` as tuples, each with its end if ``ends`` and it has one.
  py::list as_list(const std::vector<Row>& rows, bool ends) {
    py::list out(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) out[i] = as_tuple(rows[i], ends && rows[i].ended);
    return out;
  }

  std::mutex mu_;
  int64_t next_key_ = 0;
  std::map<int64_t, InFlight> in_flight_;   // keys grow with issue order
  std::vector<Row> done_;
  std::unordered_map<int32_t, Progress> progress_;
  std::vector<std::string> pgs_;
  std::unordered_map<std::string, int32_t> pg_index_;
  // Python objects, touched with the GIL held only
  std::vector<py::object> op_names_, pg_names_;
  std::unordered_map<int16_t, py::object> dtype_cache_;
  py::object host_ = py::none();
};

// A Python callable held by C++ code that may drop it without the GIL, or after the interpreter is gone.
class PyRef {
 public:
  explicit PyRef(py::object obj) : obj_(obj.release().ptr()) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (obj_ != nullptr && Py_IsInitialized() && !_Py_IsFinalizing()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(obj_);
    }
  }
  PyObject* get() const { return obj_; }

 private:
  PyObject* obj_;
};

// A work without a future: its row is completed when wait() returns, or written without an end if it is dropped
// unwaited.
class TimedWork : public c10d::Work {
 public:
  TimedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<Recorder> recorder, int64_t key)
      : inner_(std::move(inner)), recorder_(std::move(recorder)), key_(key) {}

  ~TimedWork() override {
    if (!done_.exchange(true)) recorder_->complete(key_, false, 0);
  }

  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = inner_->wait(timeout);     // raises if the collective failed: the row stays in flight
    if (!done_.exchange(true)) recorder_->complete(key_, true, now_ns());
    return ok;
  }
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<Recorder> recorder_;
  int64_t key_;
  std::atomic<bool> done_{false};
};

// ``call()`` without the GIL. A Python subclass of ProcessGroup (pg_wrapper's groups) reaches its backend through
// torch's trampoline, which holds the GIL; a gloo call made with it can deadlock against a gloo thread that frees a
// finished work's tensors (their Python objects need the GIL).
template <typename Call>
c10::intrusive_ptr<c10d::Work> without_gil(Call& call) {
  if (PyGILState_Check()) {
    py::gil_scoped_release nogil;
    return call();
  }
  return call();
}

int64_t sum_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += static_cast<int64_t>(t.nbytes());
  return n;
}

int64_t sum_bytes(const std::vector<std::vector<at::Tensor>>& lists) {
  int64_t n = 0;
  for (const auto& list : lists) n += sum_bytes(list);
  return n;
}

int16_t dtype_of(const at::Tensor& t) { return static_cast<int16_t>(t.scalar_type()); }

int16_t dtype_of(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() ? kNoDtype : dtype_of(tensors[0]);
}

int16_t dtype_of(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& list : lists) {
    if (!list.empty()) return dtype_of(list[0]);
  }
  return kNoDtype;
}

class RecordingBackend : public c10d::Backend {
 public:
  // ``resolve_key()`` returns (the group's ``pg`` key, whether to keep it): pg_wrapper's ``_pg_key``.
  RecordingBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<Recorder> recorder,
                   py::object resolve_key)
      : c10d::Backend(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        recorder_(std::move(recorder)),
        resolve_key_(std::make_shared<PyRef>(std::move(resolve_key))) {}

  // The inner gloo backend's destructor joins its threads, and one of them may be freeing a finished work whose
  // thread-local state holds Python objects (it needs the GIL). The last reference to this backend is often dropped
  // by Python (a DDP reducer freed at a script's exit, GIL held): drop the inner one without the GIL, or the join
  // waits forever.
  ~RecordingBackend() override {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      inner_.reset();
    } else {
      inner_.reset();
    }
  }

  void reset_key() { key_.store(-1); }

  // ---- collectives: recorded, then forwarded ----
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return record(BROADCAST, sum_bytes(tensors), dtype_of(tensors), [&] { return inner_->broadcast(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return record(ALLREDUCE, sum_bytes(tensors), dtype_of(tensors), [&] { return inner_->allreduce(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return record(ALLREDUCE, sum_bytes(tensors), dtype_of(tensors),
                  [&] { return inner_->allreduce_coalesced(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return record(REDUCE, sum_bytes(tensors), dtype_of(tensors), [&] { return inner_->reduce(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return record(ALLGATHER, sum_bytes(outputs), dtype_of(outputs),
                  [&] { return inner_->allgather(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    return record(ALLGATHER, static_cast<int64_t>(output.nbytes()), dtype_of(output),
                  [&] { return inner_->_allgather_base(output, input, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return record(ALLGATHER, sum_bytes(outputs), dtype_of(outputs),
                  [&] { return inner_->allgather_coalesced(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return record(ALLGATHER, sum_bytes(outputs), dtype_of(outputs),
                  [&] { return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override {
    // logical bytes: every member's input, gathered at the root
    return record(GATHER, sum_bytes(inputs) * getSize(), dtype_of(inputs),
                  [&] { return inner_->gather(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    // logical bytes: every member's output, scattered from the root
    return record(SCATTER, sum_bytes(outputs) * getSize(), dtype_of(outputs),
                  [&] { return inner_->scatter(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return record(REDUCE_SCATTER, sum_bytes(inputs), dtype_of(inputs),
                  [&] { return inner_->reduce_scatter(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    return record(REDUCE_SCATTER, static_cast<int64_t>(input.nbytes()), dtype_of(input),
                  [&] { return inner_->_reduce_scatter_base(output, input, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    return record(REDUCE_SCATTER, sum_bytes(inputs), dtype_of(inputs),
                  [&] { return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return record(ALLTOALL, static_cast<int64_t>(input.nbytes()), dtype_of(input),
                  [&] { return inner_->alltoall_base(output, input, output_splits, input_splits, opts); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return record(ALLTOALL, sum_bytes(inputs), dtype_of(inputs),
                  [&] { return inner_->alltoall(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return record(BARRIER, 0, kNoDtype, [&] { return inner_->barrier(opts); });
  }

  // ---- forwarded as they are (point-to-point is recorded by the Python group) ----
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return inner_->allreduce_sparse(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return inner_->send(tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return inner_->recv(tensors, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return inner_->recvAnysource(tensors, tag);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void startCoalescing() override { inner_->startCoalescing(); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override { return inner_->endCoalescing(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void setGroupUid(const std::string& pg_uid) override {
    c10d::Backend::setGroupUid(pg_uid);
    inner_->setGroupUid(pg_uid);
  }
  void eagerConnectSingleDevice(at::Device device) override { inner_->eagerConnectSingleDevice(device); }
  c10d::ErrorType getError() override { return inner_->getError(); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

 private:
  int32_t pg_key() {
    int32_t key = key_.load(std::memory_order_acquire);
    if (key >= 0) return key;
    std::string name;
    bool keep = false;
    {
      py::gil_scoped_acquire gil;
      py::tuple resolved = py::reinterpret_borrow<py::object>(resolve_key_->get())();
      name = resolved[0].cast<std::string>();
      keep = resolved[1].cast<bool>();
    }
    key = recorder_->intern(name);
    if (keep) key_.store(key, std::memory_order_release);
    return key;
  }

  template <typename Call>
  c10::intrusive_ptr<c10d::Work> record(Op op, int64_t num_bytes, int16_t dtype, Call call) {
    Recorder& rec = *recorder_;
    if (!rec.recording()) return without_gil(call);
    Row row{pg_key(), op, dtype, seq_.fetch_add(1) + 1, num_bytes, rec.step.load(std::memory_order_relaxed),
            now_ns(), rec.restart.load(std::memory_order_relaxed)};
    auto work = without_gil(call);    // a call that raises (bad arguments) records nothing
    if (!work || rec.enqueue_timing.load(std::memory_order_relaxed)) {
      rec.emit(row);                  // written at once, without an end
      return work;
    }
    int64_t key = rec.track(row);
    if (no_future_[op].load(std::memory_order_relaxed)) {
      return c10::make_intrusive<TimedWork>(std::move(work), recorder_, key);
    }
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work->getFuture();
    } catch (const c10::Error&) {      // gloo reduce-scatter works have no future
      no_future_[op].store(true, std::memory_order_relaxed);
      return c10::make_intrusive<TimedWork>(std::move(work), recorder_, key);
    }
    // Runs where the backend completes the work (a gloo thread), or here if it already did; a failed work is no
    // completion: its row stays in flight and is written at close without an end.
    std::shared_ptr<Recorder> recorder = recorder_;
    future->addCallback([recorder, key](c10::ivalue::Future& done) {
      if (!done.hasError()) recorder->complete(key, true, now_ns());
    }, /*uses_future=*/false);
    return work;
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::shared_ptr<Recorder> recorder_;
  std::shared_ptr<PyRef> resolve_key_;
  std::atomic<int32_t> key_{-1};
  std::atomic<int64_t> seq_{0};       // collectives on this group, 1-based in rows
  std::atomic<bool> no_future_[NUM_OPS] = {};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native recording of gloo collectives (dtprobe.collectors.native_recorder).";
  py::class_<Recorder, std::shared_ptr<Recorder>>(m, "Recorder")
      .def(py::init<>())
      .def_property("writing", [](Recorder& r) { return r.writing.load(); },
                    [](Recorder& r, bool on) { r.writing.store(on); })
      .def_property("enqueue_timing", [](Recorder& r) { return r.enqueue_timing.load(); },
                    [](Recorder& r, bool on) { r.enqueue_timing.store(on); })
      .def_property("step", [](Recorder& r) { return r.step.load(); },
                    [](Recorder& r, int64_t step) { r.step.store(step); })
      .def_property("restart", [](Recorder& r) { return r.restart.load(); },
                    [](Recorder& r, int64_t restart) { r.restart.store(restart); })
      .def("set_paused", &Recorder::set_paused)
      .def("intern", &Recorder::intern)
      .def("num_in_flight", &Recorder::num_in_flight)
      .def("flush_in_flight", &Recorder::flush_in_flight)
      .def("take", &Recorder::take)
      .def("in_flight", &Recorder::in_flight)
      .def("spill", &Recorder::spill)
      .def("reset_ticks", &Recorder::reset_ticks)
      .def("progress", &Recorder::progress)
      .def_static("set_dtype_name", &Recorder::set_dtype_name);
  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(m, "RecordingBackend")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, std::shared_ptr<Recorder>, py::object>(),
           py::arg("inner"), py::arg("recorder"), py::arg("resolve_key"))
      .def("reset_key", &RecordingBackend::reset_key);
}
