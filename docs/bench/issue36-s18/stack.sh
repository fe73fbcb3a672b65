# Sourced by qd1ab.sh and qd1sys.sh: stack_up BINDIR starts qpip-nbd-server (pid $S) on a
# 256 MiB random image in /dev/shm and qpip-nbd-mount --cache none (pid $M) on it, the FUSE
# file at $D/mnt/x; stack_down stops both and removes the image.
D=/dev/shm/s18q
stack_up() {
  rm -rf $D; mkdir -p $D/mnt
  head -c 256M /dev/urandom > $D/img
  "$1/qpip-nbd-server" -q --listen 127.0.0.1:10899 -e x=$D/img & S=$!
  sleep 0.5
  "$1/qpip-nbd-mount" --cache none nbd://127.0.0.1:10899/x $D/mnt & M=$!
  for _ in $(seq 50); do [ -e $D/mnt/x ] && break; sleep 0.1; done
}
stack_down() {
  kill $M; sleep 0.5; kill $S; wait
  rm -rf $D
}
