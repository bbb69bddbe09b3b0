/*
 * weenv escape probe (tests/test_escape.py, benchmarks/exec_hijack.py): run as root inside an
 * env, it tries to take the exec channel from the env's agent (pid 1) the ways issue 16 lists and
 * prints one line per attempt: "<attempt>: SUCCEEDED" or "<attempt>: <strerror>".
 *
 *   probe hijack PID SECONDS [SOCKET_PATH]
 *       pidfd_getfd(2) every descriptor of PID, /proc/PID/mem read-write, ptrace attach and seize,
 *       process_vm_writev, /proc/PID/fd links and /proc/PID/fd/3, /proc/PID/environ, writing /proc/PID/exe, binding
 *       SOCKET_PATH (the agent socket's host path) and connecting to it; then, for SECONDS, answers
 *       every connection on every listening socket it got with a forged result
 *       ("HIJACKED: 42 passed", exit 0), as the hijacker of issue 16 did. Prints "serving N" first.
 *   probe kill PID
 *       SIGTERM, SIGINT, SIGKILL and SIGSTOP to PID; prints whether it is still there and running.
 *
 * Run on the host against a process that nothing protects, every attempt succeeds: the tests do
 * that first, so a probe that fails for its own reasons cannot make a test pass.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define MAX_LISTENERS 64

static int listeners[MAX_LISTENERS];
static int nlisteners;

static void report(const char *what, int ok, int err) {
    printf("%s: %s\n", what, ok ? "SUCCEEDED" : strerror(err));
    fflush(stdout);
}

static int is_listener(int fd) {
    int v = 0;
    socklen_t len = sizeof v;
    return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &len) == 0 && v;
}

static void keep(int fd) {
    if (nlisteners < MAX_LISTENERS) listeners[nlisteners++] = fd;
}

static void mkdirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = 0;
            mkdir(buf, 0700);
            *p = '/';
        }
    }
}

static void serve_forged(int seconds) {
    /* 'O' "HIJACKED: 42 passed\n" then 'X' "0": the agent's frames for stdout and exit 0 */
    static const char out[] = "HIJACKED: 42 passed\n";
    unsigned char msg[64];
    size_t n = 0, len = sizeof out - 1;
    msg[n++] = 'O';
    msg[n++] = 0, msg[n++] = 0, msg[n++] = 0, msg[n++] = (unsigned char)len;
    memcpy(msg + n, out, len);
    n += len;
    msg[n++] = 'X';
    msg[n++] = 0, msg[n++] = 0, msg[n++] = 0, msg[n++] = 1;
    msg[n++] = '0';
    printf("serving %d\n", nlisteners);
    fflush(stdout);
    time_t end = time(NULL) + seconds;
    struct pollfd p[MAX_LISTENERS];
    while (time(NULL) < end && nlisteners > 0) {
        for (int i = 0; i < nlisteners; i++) p[i] = (struct pollfd){.fd = listeners[i], .events = POLLIN};
        if (poll(p, (nfds_t)nlisteners, 200) <= 0) continue;
        for (int i = 0; i < nlisteners; i++) {
            if (!(p[i].revents & POLLIN)) continue;
            int c = accept(listeners[i], NULL, NULL);
            if (c < 0) continue;
            char req[4096];
            struct pollfd q = {.fd = c, .events = POLLIN};
            if (poll(&q, 1, 1000) > 0) {
                ssize_t unused = recv(c, req, sizeof req, MSG_DONTWAIT);
                (void)unused;
            }
            send(c, msg, n, MSG_NOSIGNAL);
            usleep(100000); /* let the daemon read it before the close */
            close(c);
            printf("answered a connection\n");
            fflush(stdout);
        }
    }
}

static int hijack(pid_t pid, int seconds, const char *sock_path) {
    char what[256], path[256];
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    report("pidfd_open", pidfd >= 0, errno);
    if (pidfd >= 0) {
        int got = 0, first_err = 0;
        for (int fd = 0; fd < 64; fd++) {
            int mine = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
            if (mine >= 0) {
                got++;
                if (is_listener(mine)) keep(mine);
                else close(mine);
            } else if (errno != EBADF && !first_err) {
                first_err = errno;
            }
        }
        snprintf(what, sizeof what, "pidfd_getfd (%d descriptors, %d listening)", got, nlisteners);
        report(what, got > 0, first_err ? first_err : EBADF);
    }
    snprintf(path, sizeof path, "/proc/%d/mem", (int)pid);
    int fd = open(path, O_RDWR);
    report("open /proc/PID/mem read-write", fd >= 0, errno);
    if (fd >= 0) close(fd);
    errno = 0;
    long r = ptrace(PTRACE_ATTACH, pid, 0, 0);
    report("ptrace(PTRACE_ATTACH)", r == 0, errno);
    if (r == 0) {
        waitpid(pid, NULL, __WALL);
        ptrace(PTRACE_DETACH, pid, 0, 0);
    }
    r = ptrace(PTRACE_SEIZE, pid, 0, 0);
    report("ptrace(PTRACE_SEIZE)", r == 0, errno);
    if (r == 0) ptrace(PTRACE_DETACH, pid, 0, 0);
    /* A mapped address of the target: the first line of its maps, else where a static
     * non-PIE binary (the agent) is loaded. The byte read is written back unchanged. */
    unsigned long addr = 0x400000;
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *maps = fopen(path, "r");
    if (maps) {
        if (fscanf(maps, "%lx", &addr) != 1) addr = 0x400000;
        fclose(maps);
    }
    char byte = 0;
    struct iovec local = {.iov_base = &byte, .iov_len = 1};
    struct iovec remote = {.iov_base = (void *)addr, .iov_len = 1};
    ssize_t w = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    report("process_vm_readv", w >= 0, errno);
    w = process_vm_writev(pid, &local, 1, &remote, 1, 0);
    report("process_vm_writev", w >= 0, errno);
    /* The directory itself may open (its owner is root); its links are behind the ptrace check. */
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    int links = 0, link_err = d ? ENOENT : errno;
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            char target[256];
            if (e->d_name[0] == '.') continue;
            if (readlinkat(dirfd(d), e->d_name, target, sizeof target) >= 0) links++;
            else link_err = errno;
        }
        closedir(d);
    }
    report("read /proc/PID/fd links", links > 0, link_err);
    snprintf(path, sizeof path, "/proc/%d/fd/3", (int)pid);
    fd = open(path, O_RDWR);
    report("open /proc/PID/fd/3", fd >= 0, errno);
    if (fd >= 0) close(fd);
    snprintf(path, sizeof path, "/proc/%d/environ", (int)pid);
    fd = open(path, O_RDONLY);
    report("open /proc/PID/environ", fd >= 0, errno);
    if (fd >= 0) close(fd);
    snprintf(path, sizeof path, "/proc/%d/exe", (int)pid);
    fd = open(path, O_WRONLY);
    report("open /proc/PID/exe for writing", fd >= 0, errno);
    if (fd >= 0) close(fd);
    if (sock_path) {
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un addr = {.sun_family = AF_UNIX};
        snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock_path);
        int c = connect(s, (struct sockaddr *)&addr, sizeof addr);
        report("connect to the agent socket path", c == 0, errno);
        close(s);
        s = socket(AF_UNIX, SOCK_STREAM, 0);
        mkdirs(sock_path);
        unlink(sock_path);
        int b = bind(s, (struct sockaddr *)&addr, sizeof addr) == 0 && listen(s, 16) == 0;
        report("bind the agent socket path (in the env's own file system)", b, errno);
        if (b) keep(s);
        else close(s);
    }
    serve_forged(seconds);
    return 0;
}

static int kill_it(pid_t pid) {
    int sigs[] = {SIGTERM, SIGINT, SIGKILL, SIGSTOP};
    const char *names[] = {"SIGTERM", "SIGINT", "SIGKILL", "SIGSTOP"};
    for (int i = 0; i < 4; i++) {
        char what[64];
        snprintf(what, sizeof what, "kill(PID, %s) delivered", names[i]);
        int r = kill(pid, sigs[i]);
        report(what, r == 0, errno);
    }
    usleep(300000);
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0) close(fd);
    char state = '?';
    if (n > 0) {
        buf[n] = 0;
        char *p = strrchr(buf, ')');
        if (p && p[1]) state = p[2];
    }
    int gone = n <= 0 || state == 'T' || state == 'Z' || state == 't' || state == 'X';
    printf("stop or kill the target: %s (state %c)\n", gone ? "SUCCEEDED" : "failed", state);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "hijack")) return hijack((pid_t)atoi(argv[2]), atoi(argv[3]), argc >= 5 ? argv[4] : NULL);
    if (argc == 3 && !strcmp(argv[1], "kill")) return kill_it((pid_t)atoi(argv[2]));
    fprintf(stderr, "usage: probe hijack PID SECONDS [SOCKET_PATH] | probe kill PID\n");
    return 2;
}
