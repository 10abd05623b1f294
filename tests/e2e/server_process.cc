#include "tests/e2e/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

extern char** environ;

namespace attention::e2e {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Exit code from a waitpid status: the code, or 128 + signal as shells report it.
int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const ServerProcessOptions& options) {
  std::string dir_template =
      (std::filesystem::temp_directory_path() / "attention_e2e.XXXXXX").string();
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  const std::string dir = dir_template;
  const std::string port_file = dir + "/ports";
  const std::string log_file = dir + "/server.log";

  // ATTENTION_E2E_SERVER and ATTENTION_E2E_EXTRA_FLAGS (space-separated, after the test's own
  // flags, so they win) let the same tests run elsewhere, e.g. against --backend=cuda on a GPU
  // host.
  const char* binary_override = std::getenv("ATTENTION_E2E_SERVER");
  std::vector<std::string> args = {binary_override != nullptr ? binary_override : options.binary,
                                   "--host=127.0.0.1", "--port=0", "--metrics_port=0",
                                   "--port_file=" + port_file};
  args.insert(args.end(), options.flags.begin(), options.flags.end());
  if (const char* extra = std::getenv("ATTENTION_E2E_EXTRA_FLAGS");
      extra != nullptr && options.environment_flags) {
    for (absl::string_view flag : absl::StrSplit(extra, ' ', absl::SkipEmpty())) {
      args.emplace_back(flag);
    }
  }
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  // fork + exec rather than posix_spawn so the child can ask to be killed when the test process
  // dies (PR_SET_PDEATHSIG): a test killed by a timeout leaves no server behind. Between fork and
  // exec the child calls only async-signal-safe functions; everything it needs is prepared here.
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    std::filesystem::remove_all(dir);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    // The child's stdout and stderr both go to the log file.
    const int log = open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log < 0 || dup2(log, STDOUT_FILENO) < 0 || dup2(log, STDERR_FILENO) < 0) _exit(127);
    execve(argv[0], argv.data(), environ);
    _exit(127);  // exec failed; the parent reports the exit code with the (empty) log
  }
  std::unique_ptr<ServerProcess> server(new ServerProcess(pid, dir));

  // The server writes "<grpc_port> <metrics_port>\n" atomically once it listens.
  const absl::Time deadline = absl::Now() + options.start_timeout;
  while (true) {
    std::istringstream ports(ReadFile(port_file));
    if (ports >> server->port_ >> server->metrics_port_) break;
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      server->exited_ = true;
      return absl::FailedPreconditionError(
          absl::StrCat("attention_server exited with code ", ExitCode(status),
                       " before listening; output:\n", server->Log()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("attention_server wrote no port file within ",
                                                      absl::FormatDuration(options.start_timeout),
                                                      "; output:\n", server->Log()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return server;
}

ServerProcess::~ServerProcess() {
  if (!exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::filesystem::remove_all(dir_);
}

std::string ServerProcess::target() const { return absl::StrCat("127.0.0.1:", port_); }

absl::Status ServerProcess::Signal(int signal) {
  if (exited_ || kill(pid_, signal) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot signal server pid ", pid_));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ServerProcess::WaitForExit(absl::Duration timeout) {
  if (exited_) return absl::FailedPreconditionError("attention_server was already reaped");
  const absl::Time deadline = absl::Now() + timeout;
  int status;
  while (waitpid(pid_, &status, WNOHANG) != pid_) {
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      exited_ = true;
      return absl::DeadlineExceededError(absl::StrCat("attention_server did not exit within ",
                                                      absl::FormatDuration(timeout),
                                                      "; killed. Output:\n", Log()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  exited_ = true;
  return ExitCode(status);
}

absl::Status ServerProcess::Stop(absl::Duration timeout) {
  if (absl::Status s = Signal(SIGTERM); !s.ok()) return s;
  absl::StatusOr<int> code = WaitForExit(timeout);
  if (!code.ok()) return code.status();
  if (*code != 0) {
    return absl::InternalError(
        absl::StrCat("attention_server exited with code ", *code, "; output:\n", Log()));
  }
  return absl::OkStatus();
}

std::string ServerProcess::Log() const { return ReadFile(dir_ + "/server.log"); }

}  // namespace attention::e2e
