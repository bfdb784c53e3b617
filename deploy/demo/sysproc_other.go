//go:build !linux

package main

import "syscall"

// sysProcAttr puts each process in its own process group, so a Ctrl-C in the
// terminal reaches the demo alone and the demo stops the processes in order.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
