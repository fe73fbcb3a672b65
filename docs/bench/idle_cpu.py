import socket, struct, subprocess, sys, time, os
binary = sys.argv[1]
img = "/tmp/idle.img"
open(img, "wb").truncate(64 << 20)
srv = subprocess.Popen([binary, "--export", f"disk={img}", "-l", "127.0.0.1:10877", "-q"], stderr=subprocess.DEVNULL)
time.sleep(1)
s = socket.create_connection(("127.0.0.1", 10877))
s.recv(18)
s.sendall(struct.pack(">I", 3))
name = b"disk"
s.sendall(struct.pack(">QII", 0x49484156454F5054, 1, len(name)) + name)
s.recv(10)  # size + flags (no zeroes)
# one read so the connection is warm
s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 1, 0, 4096))
got = b""
while len(got) < 16 + 4096:
    got += s.recv(65536)
def cpu(pid):
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
        total += int(f[11]) + int(f[12])
    return total
time.sleep(1)
a = cpu(srv.pid); t0 = time.time()
time.sleep(10)
b = cpu(srv.pid); t1 = time.time()
hz = os.sysconf("SC_CLK_TCK")
print(f"{binary}: idle server with one idle client: {(b-a)/hz/(t1-t0)*100:.2f} % of a core over {t1-t0:.1f} s")
srv.terminate(); srv.wait()
