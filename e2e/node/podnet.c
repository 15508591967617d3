/* Pod networking on loopback, preloaded into every container process (LD_PRELOAD).
 *
 * Each pod owns one address 127.0.x.y (BATON_E2E_POD_IP). A server that binds "all
 * addresses" (0.0.0.0) gets the pod's address instead, so every pod can listen on the same
 * port as in a cluster. A TCP client socket is bound to the pod's address before it
 * connects, so peers see the pod IP as the source. Each connection is appended to
 * BATON_E2E_FLOW_LOG ("<dst-ip> <dst-port>"), the record the NetworkPolicy check reads.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int pod_address(struct in_addr *out) {
    const char *ip = getenv("BATON_E2E_POD_IP");
    return ip != NULL && inet_pton(AF_INET, ip, out) == 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static int (*real_bind)(int, const struct sockaddr *, socklen_t);
    if (!real_bind) real_bind = dlsym(RTLD_NEXT, "bind");
    struct in_addr pod;
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in) &&
        ((const struct sockaddr_in *)addr)->sin_addr.s_addr == htonl(INADDR_ANY) &&
        pod_address(&pod)) {
        struct sockaddr_in mine = *(const struct sockaddr_in *)addr;
        mine.sin_addr = pod;
        return real_bind(fd, (const struct sockaddr *)&mine, sizeof mine);
    }
    return real_bind(fd, addr, len);
}

static void record(const struct sockaddr_in *to) {
    const char *path = getenv("BATON_E2E_FLOW_LOG");
    if (path == NULL) return;
    char ip[INET_ADDRSTRLEN], line[64];
    if (!inet_ntop(AF_INET, &to->sin_addr, ip, sizeof ip)) return;
    int n = snprintf(line, sizeof line, "%s %u\n", ip, (unsigned)ntohs(to->sin_port));
    int saved = errno;
    int log = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (log >= 0) {
        if (write(log, line, (size_t)n) < 0) { /* best effort */ }
        close(log);
    }
    errno = saved;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static int (*real_connect)(int, const struct sockaddr *, socklen_t);
    if (!real_connect) real_connect = dlsym(RTLD_NEXT, "connect");
    struct in_addr pod;
    int type = 0;
    socklen_t type_len = sizeof type;
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in) &&
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM) {
        const struct sockaddr_in *to = (const struct sockaddr_in *)addr;
        struct sockaddr_in local;
        socklen_t local_len = sizeof local;
        int saved = errno;
        if (pod_address(&pod) && (ntohl(to->sin_addr.s_addr) >> 24) == 127 &&
            getsockname(fd, (struct sockaddr *)&local, &local_len) == 0 &&
            local.sin_port == 0 && local.sin_addr.s_addr == htonl(INADDR_ANY)) {
            struct sockaddr_in source = {.sin_family = AF_INET, .sin_port = 0, .sin_addr = pod};
            static int (*real_bind)(int, const struct sockaddr *, socklen_t);
            if (!real_bind) real_bind = dlsym(RTLD_NEXT, "bind");
            real_bind(fd, (const struct sockaddr *)&source, sizeof source);
        }
        errno = saved;
        record(to);
    }
    return real_connect(fd, addr, len);
}
