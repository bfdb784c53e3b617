package main

import "syscall"

// sysProcAttr puts each process in its own process group, so a Ctrl-C in the
// terminal reaches the demo alone and the demo stops the processes in order
// (applications before the database they write to). Pdeathsig stops a process
// should the demo itself be killed without a chance to clean up.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
