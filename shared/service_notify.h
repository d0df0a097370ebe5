// systemd's readiness protocol (sd_notify), spoken directly: one datagram a state ("READY=1",
// "STATUS=...", "WATCHDOG=1", "STOPPING=1") to the socket named by $NOTIFY_SOCKET. A process
// that systemd did not start (no $NOTIFY_SOCKET) sends nothing. Written here rather than linking
// libsystemd: the protocol is one sendto() and a watchdog interval read from the environment.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace bulkhead {

class ServiceNotifier {
 public:
  // From $NOTIFY_SOCKET and $WATCHDOG_USEC (honoured when $WATCHDOG_PID is unset or this
  // process). Clears them from the environment, so children do not report as this service.
  static ServiceNotifier fromEnvironment();

  bool enabled() const { return !socket_.empty(); }
  // Sends one state; failures are ignored (systemd may have gone away).
  void notify(std::string_view state) const;
  // How often WATCHDOG=1 is due (half the interval systemd expects); zero when no watchdog.
  std::chrono::milliseconds watchdogPeriod() const { return watchdog_period_; }

 private:
  std::string socket_;
  std::chrono::milliseconds watchdog_period_{0};
};

}  // namespace bulkhead
