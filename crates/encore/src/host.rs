//! The host's memory as the operating system reports it: what the machine
//! has available (the CPU device's memory) and what this process holds
//! resident.
//!
//! On Linux both come from `/proc`; elsewhere both are unknown (`None`), and
//! callers treat unknown as "do not check". A container's memory limit (its
//! cgroup's) is not consulted: the figures are the machine's.

use crate::record::MemoryInfo;

/// The machine's available and total memory: `MemAvailable` and `MemTotal`
/// of `/proc/meminfo`. `None` where unknown.
pub fn memory() -> Option<MemoryInfo> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        meminfo(&text)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The bytes this process holds resident (its resident set size, `VmRSS`
/// of `/proc/self/status`). `None` where unknown.
pub fn resident_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/self/status").ok()?;
        kib_field(&text, "VmRSS:")
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Free and total memory from the text of `/proc/meminfo`.
#[cfg(any(target_os = "linux", test))]
fn meminfo(text: &str) -> Option<MemoryInfo> {
    Some(MemoryInfo {
        free: kib_field(text, "MemAvailable:")?,
        total: kib_field(text, "MemTotal:")?,
    })
}

/// The value, in bytes, of a `Name:   1234 kB` line of a `/proc` file.
#[cfg(any(target_os = "linux", test))]
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let rest = text.lines().find_map(|l| l.strip_prefix(name))?;
    let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_meminfo_and_the_resident_set_in_bytes() {
        let text = "MemTotal:       24684084 kB\nMemFree:         1000 kB\n\
                    MemAvailable:   24317948 kB\n";
        assert_eq!(
            meminfo(text),
            Some(MemoryInfo {
                free: 24317948 * 1024,
                total: 24684084 * 1024
            })
        );
        assert_eq!(meminfo("MemTotal: 5 kB\n"), None);
        let status = "Name:\tencore\nVmPeak:\t  9000 kB\nVmRSS:\t   312 kB\n";
        assert_eq!(kib_field(status, "VmRSS:"), Some(312 * 1024));
        assert_eq!(kib_field("VmRSS: lots\n", "VmRSS:"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_machine_reports_its_memory_and_the_process_its_resident_set() {
        let m = memory();
        assert!(m.is_some_and(|m| m.total > 0 && m.free <= m.total), "{m:?}");
        assert!(resident_bytes().is_some_and(|r| r > 0));
    }
}
