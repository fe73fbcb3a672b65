// Session 14 standalone: sender CPU of send() from an mmap (mode 0), sendfile (1) and splice
// through an own 1 MiB pipe (2), 256 KiB chunks. gcc -O2 -o sf sendfile-vs-send.c;
// taskset -c 0 ./sf FILE MODE MIB [IP]; NS=/var/run/netns/NAME puts the receiver in that netns
// (it then connects to 10.99.0.1).
#define _GNU_SOURCE
#include <stdio.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/sendfile.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <time.h>
#include <sys/uio.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
static double cpu(){struct rusage r;getrusage(RUSAGE_SELF,&r);return r.ru_utime.tv_sec+r.ru_utime.tv_usec/1e6+r.ru_stime.tv_sec+r.ru_stime.tv_usec/1e6;}
int main(int argc,char**argv){
  const char*path=argv[1]; int mode=atoi(argv[2]); long total=atol(argv[3])<<20; const char*ip=argc>4?argv[4]:"127.0.0.1";
  size_t chunk=256*1024;
  int fd=open(path,O_RDONLY); off_t fsz=lseek(fd,0,SEEK_END);
  char*map=mmap(0,fsz,PROT_READ,MAP_SHARED,fd,0);
  int ls=socket(AF_INET,SOCK_STREAM,0); int one=1; setsockopt(ls,SOL_SOCKET,SO_REUSEADDR,&one,4);
  struct sockaddr_in a={.sin_family=AF_INET,.sin_port=htons(17777)}; inet_pton(AF_INET,ip,&a.sin_addr);
  if(bind(ls,(void*)&a,sizeof a)){perror("bind");return 1;} listen(ls,1);
  pid_t p=fork();
  if(!p){ if(getenv("NS")){int nfd=open(getenv("NS"),O_RDONLY); if(setns(nfd,CLONE_NEWNET)){perror("setns");_exit(1);} inet_pton(AF_INET,"10.99.0.1",&a.sin_addr);} cpu_set_t cs;CPU_ZERO(&cs);CPU_SET(1,&cs);sched_setaffinity(0,sizeof cs,&cs);int c=socket(AF_INET,SOCK_STREAM,0); connect(c,(void*)&a,sizeof a); char*b=malloc(1<<20); long g=0; ssize_t n; while((n=read(c,b,1<<20))>0) g+=n; _exit(0);}
  int s=accept(ls,0,0); int pfd[2]; pipe(pfd); fcntl(pfd[0],F_SETPIPE_SZ,1<<20);
  double t0=now(),c0=cpu(); long sent=0; off_t off=0; long calls=0;
  while(sent<total){
    if(off>=fsz) off=0;
    size_t want=chunk;
    ssize_t n;
    if(mode==0) n=send(s,map+off,want,0);
    else if(mode==1){ off_t o=off; n=sendfile(s,fd,&o,want);}
    else { loff_t o=off; ssize_t m=splice(fd,&o,pfd[1],0,want,SPLICE_F_MOVE); if(m<=0){perror("splice in");return 1;} n=0; while(n<m){ssize_t k=splice(pfd[0],0,s,0,m-n,SPLICE_F_MOVE|SPLICE_F_MORE); if(k<=0){perror("splice out");return 1;} n+=k;} }
    if(n<=0){perror("send");return 1;}
    off+=n; sent+=n; calls++;
  }
  double t1=now(),c1=cpu(); close(s); struct rusage cr; int st; wait4(p,&st,0,&cr); double cc=cr.ru_utime.tv_sec+cr.ru_utime.tv_usec/1e6+cr.ru_stime.tv_sec+cr.ru_stime.tv_usec/1e6;
  const char*nm[]={"send(mmap)","sendfile","splice-pipe"};printf("%-12s %5.0f MB/s sender %.3f s/GB receiver %.3f s/GB\n",nm[mode],sent/(t1-t0)/1e6,(c1-c0)/(sent/1e9),cc/(sent/1e9));
  return 0;
}
