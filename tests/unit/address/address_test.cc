#include "worker/daemon/address.h"

#include <gtest/gtest.h>

namespace vp::daemon {
namespace {

TEST(ChooseAddress, AutoTakesTheSourceAddressOfTheRouteToTheCoordinator) {
  // Loopback routes from loopback: 127.0.0.2 is answered by 127.0.0.1's interface, and the
  // source address the kernel picks for it is an address of lo.
  auto ip = ChooseAddress("auto", "", "127.0.0.1:50051");
  ASSERT_TRUE(ip.ok()) << ip.status();
  EXPECT_EQ(*ip, "127.0.0.1");
  auto unset = ChooseAddress("", "", "localhost:50051");
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_TRUE(IsLoopback(*unset)) << *unset;
}

TEST(ChooseAddress, FlagBeatsPodIpAndPodIpBeatsAuto) {
  auto flag = ChooseAddress("127.0.0.3", "127.0.0.2", "127.0.0.1:1");
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_EQ(*flag, "127.0.0.3");
  auto pod = ChooseAddress("", "127.0.0.2", "127.0.0.1:1");
  ASSERT_TRUE(pod.ok()) << pod.status();
  EXPECT_EQ(*pod, "127.0.0.2");
  // An explicit auto ignores $POD_IP.
  auto autoflag = ChooseAddress("auto", "127.0.0.2", "127.0.0.1:1");
  ASSERT_TRUE(autoflag.ok()) << autoflag.status();
  EXPECT_EQ(*autoflag, "127.0.0.1");
}

TEST(ChooseAddress, BadInputNamesTheFlagAndTheRule) {
  auto name = ChooseAddress("coordinator-host", "", "127.0.0.1:1");
  ASSERT_FALSE(name.ok());
  EXPECT_NE(name.status().message().find("--address: \"coordinator-host\" is not a numeric IP"),
            std::string::npos)
      << name.status();
  // TEST-NET-1 (RFC 5737): never an address of this host.
  auto foreign = ChooseAddress("192.0.2.1", "", "127.0.0.1:1");
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("--address: 192.0.2.1 is not an address of this host"),
            std::string::npos)
      << foreign.status();
  auto pod = ChooseAddress("", "192.0.2.1", "127.0.0.1:1");
  ASSERT_FALSE(pod.ok());
  EXPECT_NE(pod.status().message().find("$POD_IP: 192.0.2.1"), std::string::npos) << pod.status();
  auto coordinator = ChooseAddress("auto", "", "no-port");
  ASSERT_FALSE(coordinator.ok());
  EXPECT_NE(coordinator.status().message().find("--coordinator: \"no-port\" is not HOST:PORT"),
            std::string::npos)
      << coordinator.status();
}

TEST(InterfaceOf, FindsLoopback) {
  EXPECT_EQ(InterfaceOf("127.0.0.1"), "lo");
  EXPECT_EQ(InterfaceOf("192.0.2.1"), "");
}

TEST(IsLoopback, RecognisesLoopbackForms) {
  EXPECT_TRUE(IsLoopback("127.0.0.1"));
  EXPECT_TRUE(IsLoopback("127.0.1.1"));
  EXPECT_TRUE(IsLoopback("::1"));
  EXPECT_TRUE(IsLoopback("localhost"));
  EXPECT_FALSE(IsLoopback("10.0.0.5"));
  // By the numeric address, never by a name's spelling (a name resolves where DNS says).
  EXPECT_FALSE(IsLoopback("127.evil.example"));
  EXPECT_FALSE(IsLoopback("127.0.0.1.nip.io"));
  EXPECT_FALSE(IsLoopback("localhost.evil.example"));
  EXPECT_FALSE(IsLoopback("::2"));
  EXPECT_TRUE(IsLoopback("::ffff:127.0.0.1"));
  EXPECT_FALSE(IsLoopback("::ffff:10.0.0.1"));
}

TEST(ChooseAddress, UnixSocketCoordinatorIsThisHost) {
  auto ip = ChooseAddress("", "", "unix:/tmp/some/coordinator.sock");
  ASSERT_TRUE(ip.ok()) << ip.status();
  EXPECT_EQ(*ip, "127.0.0.1");
}

}  // namespace
}  // namespace vp::daemon
