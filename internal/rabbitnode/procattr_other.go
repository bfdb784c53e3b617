//go:build !linux

package rabbitnode

import "syscall"

// sysProcAttr runs the node as cred (Available fails where there is no
// rabbitmq user to run it as).
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred}
}
