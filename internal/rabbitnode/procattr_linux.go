package rabbitnode

import "syscall"

// sysProcAttr runs the node as cred, killed when the process that started
// it dies.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL, Setpgid: true}
}
