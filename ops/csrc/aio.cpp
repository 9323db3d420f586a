// aio: asynchronous file reads and writes for ZeRO-Infinity's NVMe offload.
//
// The Python side (ops/aio.py, AsyncFileIO) hands over a request as (fds, address, bytes, file
// offset); submit() cuts it into pieces and returns at once with a Ticket; worker threads move
// the pieces and the Ticket's wait() blocks without the GIL. Python keeps the tensor alive until
// the Ticket is done, so nothing here owns tensor memory (and only pybind11 is included: the op
// builds in seconds, not minutes).
//
// Three backends share the piece queue, each worker thread owning its own kernel queue:
//   io_uring  a ring set up with raw syscalls (no liburing), up to queue_depth pieces in flight
//   aio       a Linux AIO context (io_setup / io_submit / io_getevents); the kernel runs only
//             O_DIRECT transfers asynchronously, so buffered pieces are done with pread / pwrite
//   threads   pread / pwrite, one piece at a time per thread
//
// [Note: pieces]
// With O_DIRECT the file offset, length and memory address must be multiples of the block size
// (kAlign covers every common device). A request is cut into a buffered head (up to the first
// aligned file offset), a direct body and a buffered tail (the last partial block), then into
// block_size pieces: a block two requests share is only written through the page cache, so no
// read-modify-write of a block can race with another request. A direct piece whose memory is
// not aligned (a tensor view such as t[1:]) goes through an aligned bounce buffer of its slot.
//
// [Note: short transfers]
// A completion with fewer bytes than asked (end of file, a full disk, a signal) or EAGAIN
// finishes the piece synchronously in the worker: direct while the position stays aligned,
// then through the buffered descriptor. A read or write that then makes no progress is reported
// as errno -1 (short), which Python turns into an OSError naming the file and offsets.

#include <pybind11/pybind11.h>

#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kAlign = 4096;
constexpr int kShort = -1;

struct Error {
  int code = 0;
  int64_t offset = 0;  // file offset where the failed part starts
  int64_t bytes = 0;  // bytes of the piece not transferred
  int64_t done = 0;  // bytes of the piece transferred before the failure
};

// One submitted request: done when its last piece is.
class Ticket {
 public:
  explicit Ticket(int64_t pieces) : remaining_(pieces) {}

  void fail(const Error& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!has_error_) {
      has_error_ = true;
      error_ = error;
    }
  }

  void piece_done() {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = true;
      cv_.notify_all();
    }
  }

  bool done() const { return remaining_.load(std::memory_order_acquire) == 0; }

  // None on success, else (errno or -1 for short, offset, bytes, done).
  py::object wait() {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return finished_; });
    }
    if (!has_error_) return py::none();
    return py::make_tuple(error_.code, error_.offset, error_.bytes, error_.done);
  }

 private:
  std::atomic<int64_t> remaining_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool finished_ = false;
  bool has_error_ = false;
  Error error_;
};

struct Piece {
  std::shared_ptr<Ticket> ticket;
  int fd_direct = -1;
  int fd_buffered = -1;
  bool direct = false;
  bool write = false;
  char* data = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;

  int fd() const { return direct ? fd_direct : fd_buffered; }
  bool needs_bounce() const {
    return direct && reinterpret_cast<uintptr_t>(data) % kAlign != 0;
  }
};

class PieceQueue {
 public:
  void push(std::vector<Piece>&& pieces) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& piece : pieces) queue_.push_back(std::move(piece));
    }
    cv_.notify_all();
  }

  // Blocking: waits for a piece; false only once stopped and drained. Non-blocking: false
  // when empty.
  bool pop(Piece* piece, bool block) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (block) cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return false;
    *piece = std::move(queue_.front());
    queue_.pop_front();
    return true;
  }

  bool stopped_and_empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stop_ && queue_.empty();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool stop_ = false;
};

struct AlignedBuffer {
  char* data = nullptr;
  void ensure(int64_t bytes) {
    if (data == nullptr && posix_memalign(reinterpret_cast<void**>(&data), kAlign, bytes) != 0) {
      data = nullptr;
      throw std::bad_alloc();
    }
  }
  ~AlignedBuffer() { free(data); }
};

// Moves bytes [done, nbytes) of a piece with pread / pwrite (see [Note: short transfers]).
// For a bounced direct piece, `bounce` holds the first `done` bytes (and, for a write, all).
void finish_sync(const Piece& p, char* bounce, int64_t done) {
  bool bounced = p.needs_bounce();
  if (p.direct) {
    char* buf = bounced ? bounce : p.data;
    if (bounced && p.write && done == 0) std::memcpy(bounce, p.data, p.nbytes);
    while (done < p.nbytes && done % kAlign == 0) {
      ssize_t n = p.write ? pwrite(p.fd_direct, buf + done, p.nbytes - done, p.offset + done)
                          : pread(p.fd_direct, buf + done, p.nbytes - done, p.offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EINVAL) {
        p.ticket->fail({errno, p.offset + done, p.nbytes - done, done});
        return;
      }
      if (n <= 0) break;  // EOF, no progress or EINVAL: let the buffered path decide
      if (bounced && !p.write) std::memcpy(p.data + done, bounce + done, n);
      done += n;
    }
  }
  while (done < p.nbytes) {
    ssize_t n = p.write ? pwrite(p.fd_buffered, p.data + done, p.nbytes - done, p.offset + done)
                        : pread(p.fd_buffered, p.data + done, p.nbytes - done, p.offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      p.ticket->fail({n < 0 ? errno : kShort, p.offset + done, p.nbytes - done, done});
      return;
    }
    done += n;
  }
}

class Worker {
 public:
  Worker(PieceQueue* queue, int64_t block_size) : queue_(queue), block_size_(block_size) {}
  virtual ~Worker() = default;
  virtual void run() = 0;

 protected:
  PieceQueue* queue_;
  int64_t block_size_;
};

class ThreadWorker : public Worker {
 public:
  using Worker::Worker;
  void run() override {
    Piece piece;
    while (queue_->pop(&piece, /*block=*/true)) {
      if (piece.needs_bounce()) bounce_.ensure(block_size_);
      finish_sync(piece, bounce_.data, 0);
      piece.ticket->piece_done();
      piece = Piece();
    }
  }

 private:
  AlignedBuffer bounce_;
};

// A worker with up to queue_depth pieces in flight in a kernel queue; subclasses submit and reap.
class AsyncWorker : public Worker {
 public:
  AsyncWorker(PieceQueue* queue, int64_t block_size, int queue_depth)
      : Worker(queue, block_size), slots_(queue_depth) {}

  void run() override {
    std::vector<int> free_slots;
    for (int i = static_cast<int>(slots_.size()) - 1; i >= 0; --i) free_slots.push_back(i);
    int in_flight = 0;
    while (true) {
      while (!free_slots.empty()) {
        Slot& slot = slots_[free_slots.back()];
        if (!queue_->pop(&slot.piece, /*block=*/in_flight == 0)) break;
        if (!slot.piece.direct && !async_buffered()) {
          finish_sync(slot.piece, nullptr, 0);
          release(slot);
          continue;
        }
        if (slot.piece.needs_bounce()) {
          slot.bounce.ensure(block_size_);
          if (slot.piece.write) std::memcpy(slot.bounce.data, slot.piece.data, slot.piece.nbytes);
        }
        int index = free_slots.back();
        if (!prepare(index, slot)) {  // the kernel queue refused it: do it here
          finish_sync(slot.piece, slot.bounce.data, 0);
          release(slot);
          continue;
        }
        free_slots.pop_back();
        ++in_flight;
      }
      if (in_flight == 0) {
        if (queue_->stopped_and_empty()) return;
        continue;
      }
      completions_.clear();
      submit_and_wait(&completions_);
      for (auto [index, result] : completions_) {
        complete(slots_[index], result);
        free_slots.push_back(index);
        --in_flight;
      }
    }
  }

 protected:
  struct Slot {
    Piece piece;
    AlignedBuffer bounce;
    iocb cb;
  };

  static char* buffer(Slot& slot) {
    return slot.piece.needs_bounce() ? slot.bounce.data : slot.piece.data;
  }

  virtual bool async_buffered() const = 0;
  // Queue the slot's transfer; false where the kernel queue cannot take it.
  virtual bool prepare(int index, Slot& slot) = 0;
  // Submit what was prepared, wait for at least one completion, append (slot, result) pairs.
  virtual void submit_and_wait(std::vector<std::pair<int, int64_t>>* completions) = 0;

  std::vector<Slot> slots_;
  std::vector<std::pair<int, int64_t>> completions_;

 private:
  static void release(Slot& slot) {
    slot.piece.ticket->piece_done();
    slot.piece = Piece();
  }

  static void complete(Slot& slot, int64_t result) {
    const Piece& p = slot.piece;
    if (result == p.nbytes) {
      if (p.needs_bounce() && !p.write) std::memcpy(p.data, slot.bounce.data, p.nbytes);
    } else if (result >= 0 || result == -EAGAIN || result == -EINTR) {
      int64_t done = std::max<int64_t>(result, 0);
      if (p.needs_bounce() && !p.write) std::memcpy(p.data, slot.bounce.data, done);
      finish_sync(p, slot.bounce.data, done);
    } else {
      p.ticket->fail({static_cast<int>(-result), p.offset, p.nbytes, 0});
    }
    release(slot);
  }
};

class UringWorker : public AsyncWorker {
 public:
  UringWorker(PieceQueue* queue, int64_t block_size, int queue_depth)
      : AsyncWorker(queue, block_size, queue_depth) {
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    fd_ = static_cast<int>(syscall(__NR_io_uring_setup, queue_depth, &params));
    if (fd_ < 0) throw std::runtime_error(std::string("io_uring_setup: ") + strerror(errno));
    sq_len_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_len_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    single_mmap_ = params.features & IORING_FEAT_SINGLE_MMAP;
    if (single_mmap_) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sqes_len_ = params.sq_entries * sizeof(io_uring_sqe);
    sq_ = map(sq_len_, IORING_OFF_SQ_RING);
    cq_ = single_mmap_ ? sq_ : map(cq_len_, IORING_OFF_CQ_RING);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_len_, IORING_OFF_SQES));
    sq_tail_ = field(sq_, params.sq_off.tail);
    sq_mask_ = *field(sq_, params.sq_off.ring_mask);
    sq_array_ = field(sq_, params.sq_off.array);
    cq_head_ = field(cq_, params.cq_off.head);
    cq_tail_ = field(cq_, params.cq_off.tail);
    cq_mask_ = *field(cq_, params.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(static_cast<char*>(cq_) + params.cq_off.cqes);
  }

  ~UringWorker() override {
    if (sqes_ != nullptr) munmap(sqes_, sqes_len_);
    if (cq_ != nullptr && !single_mmap_) munmap(cq_, cq_len_);
    if (sq_ != nullptr) munmap(sq_, sq_len_);
    if (fd_ >= 0) close(fd_);
  }

 protected:
  bool async_buffered() const override { return true; }

  bool prepare(int index, Slot& slot) override {
    // Only this thread touches the submission ring; the kernel reads the tail we publish.
    unsigned tail = *sq_tail_;
    unsigned at = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[at];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = slot.piece.write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = slot.piece.fd();
    sqe->addr = reinterpret_cast<uint64_t>(buffer(slot));
    sqe->len = static_cast<uint32_t>(slot.piece.nbytes);
    sqe->off = static_cast<uint64_t>(slot.piece.offset);
    sqe->user_data = static_cast<uint64_t>(index);
    sq_array_[at] = at;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++to_submit_;
    return true;
  }

  void submit_and_wait(std::vector<std::pair<int, int64_t>>* completions) override {
    // EINTR: interrupted before submitting anything; EAGAIN / EBUSY: the kernel is short of
    // resources for a moment. Any other error means a broken ring (an internal invariant).
    while (true) {
      long n = syscall(__NR_io_uring_enter, fd_, to_submit_, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
      if (n >= 0) {
        to_submit_ -= static_cast<unsigned>(n);
        break;
      }
      if (errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        throw std::runtime_error(std::string("io_uring_enter: ") + strerror(errno));
      }
      if (errno != EINTR) std::this_thread::yield();
    }
    unsigned head = *cq_head_;
    unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    for (; head != tail; ++head) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      completions->emplace_back(static_cast<int>(cqe.user_data), cqe.res);
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  }

 private:
  void* map(size_t len, off_t what) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("io_uring mmap: ") + strerror(errno));
    return p;
  }
  static unsigned* field(void* base, uint32_t offset) {
    return reinterpret_cast<unsigned*>(static_cast<char*>(base) + offset);
  }

  int fd_ = -1;
  bool single_mmap_ = false;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  void* sq_ = nullptr;
  void* cq_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned to_submit_ = 0;
};

class KernelAioWorker : public AsyncWorker {
 public:
  KernelAioWorker(PieceQueue* queue, int64_t block_size, int queue_depth)
      : AsyncWorker(queue, block_size, queue_depth), events_(queue_depth) {
    if (syscall(__NR_io_setup, queue_depth, &context_) < 0) {
      throw std::runtime_error(std::string("io_setup: ") + strerror(errno));
    }
  }
  ~KernelAioWorker() override { syscall(__NR_io_destroy, context_); }

 protected:
  bool async_buffered() const override { return false; }

  bool prepare(int index, Slot& slot) override {
    std::memset(&slot.cb, 0, sizeof(slot.cb));
    slot.cb.aio_data = static_cast<uint64_t>(index);
    slot.cb.aio_lio_opcode = slot.piece.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    slot.cb.aio_fildes = static_cast<uint32_t>(slot.piece.fd());
    slot.cb.aio_buf = reinterpret_cast<uint64_t>(buffer(slot));
    slot.cb.aio_nbytes = static_cast<uint64_t>(slot.piece.nbytes);
    slot.cb.aio_offset = slot.piece.offset;
    iocb* list[1] = {&slot.cb};
    long n;
    do {
      n = syscall(__NR_io_submit, context_, 1, list);
    } while (n < 0 && errno == EINTR);
    return n == 1;
  }

  void submit_and_wait(std::vector<std::pair<int, int64_t>>* completions) override {
    long n;
    do {
      n = syscall(__NR_io_getevents, context_, 1, events_.size(), events_.data(), nullptr);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw std::runtime_error(std::string("io_getevents: ") + strerror(errno));
    for (long i = 0; i < n; ++i) {
      completions->emplace_back(static_cast<int>(events_[i].data), events_[i].res);
    }
  }

 private:
  aio_context_t context_ = 0;
  std::vector<io_event> events_;
};

class Engine {
 public:
  Engine(int64_t block_size, int queue_depth, int threads, const std::string& backend)
      : block_size_(block_size), backend_(backend) {
    if (block_size <= 0 || block_size % kAlign != 0 || block_size > (1LL << 30)) {
      throw std::invalid_argument("block_size must be a multiple of 4096 up to 1 GiB");
    }
    if (queue_depth < 1 || threads < 1) {
      throw std::invalid_argument("queue_depth and threads must be >= 1");
    }
    for (int i = 0; i < threads; ++i) {
      if (backend == "io_uring") {
        workers_.push_back(std::make_unique<UringWorker>(&queue_, block_size, queue_depth));
      } else if (backend == "aio") {
        workers_.push_back(std::make_unique<KernelAioWorker>(&queue_, block_size, queue_depth));
      } else if (backend == "threads") {
        workers_.push_back(std::make_unique<ThreadWorker>(&queue_, block_size));
      } else {
        throw std::invalid_argument("unknown backend " + backend);
      }
    }
    for (auto& worker : workers_) threads_.emplace_back([w = worker.get()] { w->run(); });
  }

  ~Engine() { close(); }

  // See [Note: pieces]. fd_direct < 0: everything buffered.
  std::shared_ptr<Ticket> submit(int fd_direct, int fd_buffered, bool write, uintptr_t address,
                                 int64_t nbytes, int64_t offset) {
    if (threads_.empty()) throw std::runtime_error("submit on a closed aio engine");
    struct Segment {
      bool direct;
      int64_t start, length;
    };
    std::vector<Segment> segments;
    if (fd_direct < 0) {
      segments.push_back({false, 0, nbytes});
    } else {
      int64_t head = std::min(nbytes, (kAlign - offset % kAlign) % kAlign);
      int64_t body = (nbytes - head) / kAlign * kAlign;
      segments = {{false, 0, head}, {true, head, body}, {false, head + body, nbytes - head - body}};
    }
    std::vector<Piece> pieces;
    for (const auto& s : segments) {
      for (int64_t at = s.start; at < s.start + s.length; at += block_size_) {
        Piece p;
        p.fd_direct = fd_direct;
        p.fd_buffered = fd_buffered;
        p.direct = s.direct;
        p.write = write;
        p.data = reinterpret_cast<char*>(address) + at;
        p.nbytes = std::min(block_size_, s.start + s.length - at);
        p.offset = offset + at;
        pieces.push_back(std::move(p));
      }
    }
    auto ticket = std::make_shared<Ticket>(static_cast<int64_t>(pieces.size()));
    for (auto& p : pieces) p.ticket = ticket;
    if (pieces.empty()) return ticket;  // zero bytes: already done
    queue_.push(std::move(pieces));
    return ticket;
  }

  // Finishes every queued piece, then stops the workers.
  void close() {
    if (threads_.empty()) return;
    queue_.stop();
    py::gil_scoped_release release;
    for (auto& thread : threads_) thread.join();
    threads_.clear();
    workers_.clear();
  }

  const std::string& backend() const { return backend_; }

 private:
  int64_t block_size_;
  std::string backend_;
  PieceQueue queue_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::thread> threads_;
};

bool io_uring_works() {
  io_uring_params params;
  std::memset(&params, 0, sizeof(params));
  long fd = syscall(__NR_io_uring_setup, 2, &params);
  if (fd < 0) return false;
  close(static_cast<int>(fd));
  return true;
}

bool kernel_aio_works() {
  aio_context_t context = 0;
  if (syscall(__NR_io_setup, 2, &context) < 0) return false;
  syscall(__NR_io_destroy, context);
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Ticket, std::shared_ptr<Ticket>>(m, "Ticket")
      .def("done", &Ticket::done, "True once every piece finished (never blocks)")
      .def("wait", &Ticket::wait,
           "Block without the GIL; None, or (errno or -1 for short, offset, bytes, done)");
  py::class_<Engine>(m, "Engine")
      .def(py::init<int64_t, int, int, const std::string&>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("threads"), py::arg("backend"))
      .def("submit", &Engine::submit, py::arg("fd_direct"), py::arg("fd_buffered"),
           py::arg("write"), py::arg("address"), py::arg("nbytes"), py::arg("offset"))
      .def("close", &Engine::close)
      .def_property_readonly("backend", &Engine::backend);
  m.def("io_uring_works", &io_uring_works, "io_uring_setup succeeds in this process");
  m.def("kernel_aio_works", &kernel_aio_works, "io_setup succeeds in this process");
}
